"""FP8 (e4m3) storage with per-head scales.

Keys and values are RMS-normalised per head with a learned gain g (H, D), so every
element obeys |x| <= ||x||_2 <= max|g_h| * sqrt(D), and rotations (RoPE, the reset's
delta rotation) keep that norm. A scale of max|g_h| * sqrt(D) / 448 per head therefore
never saturates, is known before any data arrives, and survives any rotation, so a
reset re-rounds keys with the scale they were stored with.
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def per_head_scale(gain: torch.Tensor) -> torch.Tensor:
    """Scale (H,) for RMS-normalised heads with gain (H, D)."""
    return gain.detach().abs().amax(dim=-1).to(torch.float32) * math.sqrt(gain.shape[-1]) / FP8_MAX


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (H, N, D) to FP8 with scale (H,); values beyond the range clamp (never NaN)."""
    s = scale.to(x.device).view(-1, 1, 1)
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    s = scale.to(q.device).view(-1, 1, 1)
    return (q.float() * s).to(dtype)


def relative_step(x: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3 values near |x| (in x's own units): 2^(floor(log2|x|) - 3), subnormals at 2^-9."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0**-6)))
    return torch.exp2(e - 3)
