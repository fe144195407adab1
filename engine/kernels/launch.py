"""How the kernels launch: feature probes (Triton importable, the interpreter, Hopper features, each probed once
and logged in one line), programmatic dependent launch (on unless TALKLOOP_PDL=0), FMA fusion, and the head sizes
the warp-specialised attention is built for. Every kernel file imports this; it imports no kernel. Triton itself is
imported only by the probes that need it: this module loads without it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger("talkloop.kernels")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Every launch asks for a * b + c as one FMA, as the kernels were written for: a Triton that turns that fusion off by
# default (announced for 3.10) would add instructions to every inner loop and change roundings.
FP_FUSION = {"enable_fp_fusion": True}


@functools.cache
def available() -> bool:
    """Triton importable, and either a CUDA GPU or the interpreter to run it on."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        log.info("Triton kernels off: triton not importable (%s); using the PyTorch paths", e)
        return False
    if not (torch.cuda.is_available() or interpreting()):
        log.info("Triton kernels off: no CUDA GPU; using the PyTorch paths")
        return False
    log.info("Triton kernels on (%s)", "interpreter" if interpreting() else torch.cuda.get_device_name())
    return True


def supports_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


WS_HEAD_DIMS = (32, 64, 128)  # head sizes the warp-specialised kernel is built for


def hopper_feature(device_index: int, feature: str, module: str, fallback: str,
                   build: Callable[[], object] | None = None, later_too: bool = False) -> bool:
    """A Hopper GPU (sm_90; with `later_too`, sm_90 or later) and a Triton with `module` importable, and where `build`
    is given, one that builds the kernel (an API that moved between Triton versions shows here, not at the first
    call): whether `feature` runs, with one log line either way (`fallback`: what serves instead). Callers cache it
    per device."""
    capability = torch.cuda.get_device_capability(device_index)
    if capability[0] < 9 or (capability[0] > 9 and not later_too):
        log.info("%s off: it is for %s, this GPU is sm_%d%d; %s", feature, "sm_90 and later" if later_too else "Hopper",
                 *capability, fallback)
        return False
    try:
        importlib.import_module(module)
    except Exception as e:  # an older Triton
        log.info("%s off: %s not importable (%s); %s", feature, module, e, fallback)
        return False
    if build is not None:
        try:
            build()
        except Exception as e:  # a Triton whose API moved under the kernel
            lines = str(e).strip().splitlines()  # a compiler error ends with its reason
            log.info("%s off: this Triton does not build it (%s: %s); %s", feature, type(e).__name__,
                     lines[-1][:200] if lines else "", fallback)
            return False
    log.info("%s on (%s)", feature, torch.cuda.get_device_name(device_index))
    return True


# Programmatic dependent launch: a kernel launched with it may start on the SMs its stream's previous kernel
# frees as that one ends (its programs wait in `gdc_wait` until that kernel's writes are visible), rather than
# after the gap between the two. The Triton kernels of the step take it (the FP8 GEMMs, the frame write, the
# row kernels); none triggers its dependents early, and the ws attention does not wait this way (docs/kernels.md).
# TALKLOOP_PDL=0 turns it off; it is read at each launch, and a CUDA graph keeps what held when it was captured.
PDL_ENV = "TALKLOOP_PDL"


def _pdl_probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(x):
        tl.extra.cuda.gdc_wait()
        tl.store(x, tl.load(x) + 1)

    return _probe


def _build_pdl(device_index: int) -> None:
    """Compile a kernel that waits for the previous one, with launch_pdl, for this GPU (no launch: the first call may
    come while a CUDA graph is being captured)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.compiler import ASTSource

    if "launch_pdl" not in CUDAOptions.__dataclass_fields__:
        raise RuntimeError("this Triton has no launch_pdl option")
    major, minor = torch.cuda.get_device_capability(device_index)
    triton.compile(ASTSource(_pdl_probe_kernel(), {"x": "*i32"}), target=GPUTarget("cuda", 10 * major + minor, 32),
                   options={"launch_pdl": True, **FP_FUSION})


@functools.cache
def pdl_runs(device_index: int) -> bool:
    """A GPU of sm_90 or later and a Triton with `gdc_wait` and `launch_pdl`; probed once per device."""
    return hopper_feature(device_index, "programmatic dependent launch", "triton.language.extra.cuda",
                          "each kernel launches once the one before it has ended", build=lambda: _build_pdl(device_index),
                          later_too=True)


def launch_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: wanted (TALKLOOP_PDL not "0", read
    at each launch) and probed to run; never under the interpreter."""
    wanted = os.environ.get(PDL_ENV, "1") != "0"
    return wanted and device.type == "cuda" and not interpreting() and pdl_runs(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> tuple[bool, dict]:
    """A kernel's PDL constexpr (common.wait_for_previous_kernel) and its launch keywords, passed only when on
    (the interpreter never sees them)."""
    return (True, {"launch_pdl": True}) if launch_pdl(device) else (False, {})
