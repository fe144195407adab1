"""Pieces shared by the kernels."""

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
