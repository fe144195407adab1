"""Rotary position embeddings over (time, height, width).

A head's dims are taken as adjacent pairs (x[2i], x[2i+1]); the first pairs rotate
with the temporal position, the next with the row, the last with the column. Angles
are computed in float64 and only then cast, so positions far from zero (the plain
reference path never resets them) lose no precision before the rotation itself.
"""

from __future__ import annotations

import torch

from engine.config import ModelSpec


def axis_frequencies(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair angular frequencies of each axis, float64."""
    out = []
    for d in spec.rope_dims:
        exponent = torch.arange(0, d, 2, dtype=torch.float64) / d
        out.append(spec.rope_theta ** -exponent)
    return out[0], out[1], out[2]


def rope_angles(spec: ModelSpec, t: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Angles (N, head_dim/2), float64, for tokens at positions t, y, x (each (N,))."""
    ft, fh, fw = axis_frequencies(spec)
    t, y, x = (p.to(torch.float64).reshape(-1, 1) for p in (t, y, x))
    return torch.cat([t * ft, y * fh, x * fw], dim=-1)


def cos_sin(angles: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cos(angles).to(dtype=dtype, device=device), torch.sin(angles).to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., N, D) by angles given as cos/sin (N, D/2) or (D/2,)."""
    pairs = x.unflatten(-1, (-1, 2))  # (..., N, D/2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def temporal_delta_angles(spec: ModelSpec, delta: float) -> torch.Tensor:
    """Angles (D/2,) that move a key by `delta` frames in time and nowhere in space.

    R(a)R(b) = R(a+b): rotating a key stored at position p by this gives the key at
    p + delta, which is how a position reset keeps every relative position.
    """
    ft, fh, fw = axis_frequencies(spec)
    return torch.cat([delta * ft, torch.zeros_like(fh), torch.zeros_like(fw)])


def frame_positions(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of a latent frame's tokens: the video grid, then audio tokens on the row below it."""
    gh, gw = spec.token_grid
    rows = torch.arange(gh, dtype=torch.float64).repeat_interleave(gw)
    cols = torch.arange(gw, dtype=torch.float64).repeat(gh)
    audio_cols = torch.arange(spec.audio_tokens, dtype=torch.float64)
    audio_rows = torch.full_like(audio_cols, float(gh))
    return torch.cat([rows, audio_rows]), torch.cat([cols, audio_cols])


def reference_positions(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of the reference tokens, spread over the same extent as the video grid."""
    rh, rw = spec.reference_grid
    gh, gw = spec.token_grid
    rows = (torch.arange(rh, dtype=torch.float64) * (gh / rh)).repeat_interleave(rw)
    cols = (torch.arange(rw, dtype=torch.float64) * (gw / rw)).repeat(rh)
    return rows, cols
