"""Kernel policy: which kernels run where. The attention kernel's choice and launcher, the GEMM modes the
block linears may run in, and in the FP8 modes each block linear's GEMM kernel (cuBLAS or the Triton FP8 GEMM).
It imports the kernel files only inside the functions that choose them (they need Triton; this module loads
without it); how kernels launch is launch.py's.
"""

from __future__ import annotations

import functools
import os

import torch

from engine.kernels.launch import WS_HEAD_DIMS, hopper_feature

# The blocks' big linears: as built (bf16/float) | FP8 | FP8 with the tensor cores' fast accumulation (GPU)
GEMM_MODES = ("plain", "fp8", "fp8-fast")


# The FP8 linears' product, per block linear: one of fp8_linear.FP8_GEMM_KERNELS, cuBLAS unless chosen here
FP8_GEMM_ENV = "TALKLOOP_FP8_GEMM"  # "auto" (the default) or "cublas": every FP8 linear on cuBLAS, in every process
# on the Triton plain form by default where all three outputs tile in fp8_linear.PLAIN_BLOCK
TRITON_PLAIN_LINEARS = ("qkv", "attn_out", "mlp_out")


@functools.cache
def triton_fp8_gemm_runs(device_index: int) -> bool:
    """A Hopper GPU (sm_90) and a Triton with host-side TMA descriptors; probed once per device."""
    return hopper_feature(device_index, "Triton FP8 GEMM (MLP-in with SwiGLU in its epilogue; q/k/v and MLP-out where they tile)", "triton.tools.tensor_descriptor",
                          "cuBLAS serves every FP8 linear")


def default_gemm_kernels(device: torch.device | None, widths: dict[str, int]) -> dict[str, str]:
    """Per block linear, the FP8 product's kernel, from the linears' output widths (`widths`: name -> out_features):
    on Hopper the Triton SwiGLU form for MLP-in where its gate and up halves tile (no (M, 2H) product stored and
    read back by a SwiGLU pass), and with it the plain form in 128x256 tiles for q/k/v, the out-projection and
    MLP-out where all three outputs tile in 256 columns (launched with PDL, as cuBLAS's GEMMs are not; why:
    docs/kernels.md); cuBLAS for the rest and elsewhere, and for all with TALKLOOP_FP8_GEMM=cublas."""
    choice = os.environ.get(FP8_GEMM_ENV, "auto")
    if choice not in ("auto", "cublas"):
        raise ValueError(f"{FP8_GEMM_ENV} must be auto or cublas, got {choice!r}")
    chosen = hopper_gemm_kernels(widths)
    if choice != "auto" or not chosen or device is None or device.type != "cuda":
        return {}
    if not triton_fp8_gemm_runs(device.index or 0):  # probed (and logged) only where it would be used
        return {}
    return chosen


def hopper_gemm_kernels(widths: dict[str, int]) -> dict[str, str]:
    """The block linears the Triton FP8 GEMM takes on Hopper, by their output widths (`default_gemm_kernels`'s rule:
    where the kernel's tiles fit them)."""
    from engine.kernels.fp8_linear import PLAIN_BLOCK, swiglu_block

    if not swiglu_block(widths["mlp_in"]):
        return {}
    chosen = {"mlp_in": "triton"}
    if all(widths[name] % PLAIN_BLOCK == 0 for name in TRITON_PLAIN_LINEARS):
        chosen.update(dict.fromkeys(TRITON_PLAIN_LINEARS, "triton"))
    return chosen


def block_gemm_kernels(model: torch.nn.Module, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The FP8 product's kernel per block linear of `model`, as fp8_linear.quantize_linears_ takes them: `overrides`
    (linear name -> kernel) over `default_gemm_kernels` for the GPU the model is on and its blocks' widths."""
    from engine.kernels.fp8_linear import linear_widths

    device = next((p.device for p in model.parameters() if p.is_cuda), None)
    return {**default_gemm_kernels(device, linear_widths(model.blocks[0])), **(overrides or {})}


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
