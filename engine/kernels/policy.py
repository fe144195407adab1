"""Kernel policy: which kernels run where. The attention kernel's choice and launcher, and the GEMM modes the
block linears may run in. It imports the kernel files only inside the functions that choose them (they need
Triton; this module loads without it); how kernels launch is launch.py's.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels.launch import WS_HEAD_DIMS, hopper_feature

# The blocks' big linears: as built (bf16/float) | FP8 | FP8 with the tensor cores' fast accumulation (GPU)
GEMM_MODES = ("plain", "fp8", "fp8-fast")


# The FP8 attention kernel over the ring: fp8_attention.py (Triton, any GPU with FP8 tensor cores and the
# CPU interpreter) | fp8_attention_ws.py (Gluon, warp-specialised, Hopper only) | auto: ws where it runs
ATTENTION_KERNELS = ("auto", "triton", "ws")


def _build_ws_attention() -> None:
    from engine.kernels.fp8_attention_ws import compile_for_hopper

    compile_for_hopper()


@functools.cache
def warp_specialized_attention_runs(device_index: int) -> bool:
    """A Hopper GPU (sm_90) and a Triton whose Gluon builds the kernel; probed once per device."""
    return hopper_feature(device_index, "warp-specialised FP8 attention", "triton.experimental.gluon.language.nvidia.hopper",
                          "the Triton FP8 attention kernel serves", build=_build_ws_attention)


def check_attention_kernel(kernel: str) -> str:
    """`kernel` if it is one of ATTENTION_KERNELS, else a ValueError naming them."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
    return kernel


def attention_kernel(kernel: str, device: torch.device, head_dim: int) -> str:
    """`kernel` (one of ATTENTION_KERNELS) resolved for `device` and `head_dim`: "triton" or "ws"."""
    if check_attention_kernel(kernel) == "triton":
        return kernel
    runs = device.type == "cuda" and head_dim in WS_HEAD_DIMS and warp_specialized_attention_runs(device.index or 0)
    if kernel == "ws" and not runs:
        raise ValueError(f"the ws attention kernel needs a Hopper GPU (sm_90), Triton with Gluon and a head size in "
                         f"{WS_HEAD_DIMS} (here: {device}, head size {head_dim}); use triton")
    return "ws" if runs else "triton"


def attention_option_names(kernel: str) -> set[str]:
    """The tile options a kernel's launcher takes (`kernel` one of ATTENTION_KERNELS; auto: either's)."""
    import inspect

    from engine.kernels.fp8_attention import FP8Attention
    from engine.kernels.fp8_attention_ws import WarpSpecializedFP8Attention

    shape = {"self", "n_heads", "n_queries", "n_slots", "head_dim", "device"}
    names = {name: set(inspect.signature(c.__init__).parameters) - shape
             for name, c in (("triton", FP8Attention), ("ws", WarpSpecializedFP8Attention))}
    return names[kernel] if kernel in names else names["triton"] | names["ws"]


def make_attention(kernel: str, n_heads: int, n_queries: int, n_slots: int, head_dim: int, device, **options):
    """The launcher of a resolved attention kernel ("triton" or "ws") with that kernel's tile options."""
    if kernel == "ws":
        from engine.kernels.fp8_attention_ws import (
            WarpSpecializedFP8Attention as launcher,
        )
    else:
        from engine.kernels.fp8_attention import FP8Attention as launcher
    return launcher(n_heads, n_queries, n_slots, head_dim, device, **options)
