import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter (set before any kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_patched_namespaces() -> list:
    """What Triton's interpreter patches while it runs a kernel: triton.language, its core, tensor, dtype, math,
    condition and descriptor classes."""
    try:
        import triton.language as tl
    except ImportError:
        return []
    return [tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.condition, tl.core.tensor_descriptor_base]


_PRISTINE = [(space, dict(vars(space))) for space in _interpreter_patched_namespaces()]


@pytest.fixture(autouse=True)
def _triton_language_as_it_was():
    """The interpreter restores triton.language after a kernel, but not after a nested @triton.jit call (Triton
    3.9): an interpreted kernel that calls a helper leaves builtins patched for the interpreter, and a later
    in-process GPU build in the same pytest process (Gluon's, for one) fails to trace. Put them back after each test."""
    yield
    for space, attrs in _PRISTINE:  # the interpreter patches names that exist; names added since (submodules) stay
        for name, value in attrs.items():
            if vars(space).get(name) is not value:
                setattr(space, name, value)


@pytest.fixture(autouse=True)
def _torch_threads_as_they_were():
    """An engine built with `threads` sets torch's thread count for the whole process; later tests keep theirs."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
