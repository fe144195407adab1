"""Pieces shared by the kernels: @triton.jit helpers, no kernels or launchers of their own.

Their PyTorch counterparts: `to_fp8` is a saturating cast, `x.clamp(-448, 448).to(torch.float8_e4m3fn)`
(engine/fp8.py's `quantize`); `round_to` is `x.to(dtype).float()`.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def to_fp8(x, EXACT: tl.constexpr):
    """Saturating round-to-nearest-even cast of float32 x to e4m3.

    EXACT rounds in float32 arithmetic first (for the interpreter); on the GPU the
    hardware cast (cvt.rn.satfinite) saturates and rounds in one instruction.
    """
    if EXACT:
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        step = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(x), 0.015625))) - 3.0)
        v = x / step
        x = ((v + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: rounds half to even
    return x.to(tl.float8e4nv)


@triton.jit
def round_to(x, dtype: tl.constexpr, EXACT: tl.constexpr):
    """float32 x rounded to `dtype` (nearest even) and back to float32, as storing it in that type would.

    The interpreter casts float32 to bf16 by truncation; EXACT rounds by the bits instead.
    """
    if dtype == tl.float32:
        return x
    if EXACT and dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With PDL (the kernel launched with programmatic dependent launch, so its programs may start while the
    stream's previous kernel ends): wait until that kernel has finished and its writes are visible, before this
    program reads or writes anything."""
    if PDL:
        tl.extra.cuda.gdc_wait()
