"""KV caches: the ring (the serving path) and the plain reference (the oracle).

Both give the model the same `attend(layer, q, k, v)` and `reference_attend(...)`,
take un-rotated per-head q, k, v (H, N, D) of the newest frame, and agree on what
a frame sees: the reference sink, the previous `window_frames - 1` frames and the
frame itself. Every pass of a step rewrites the newest frame's K/V, so the last
pass's K/V is what later frames read.

Positions. Frame t sits at temporal position `sink_distance + t` in the reference
path. The ring keeps positions small instead: every `reset_every` steps it moves
every cached key back by that many frames in one delta rotation (R(a)R(b) =
R(a+b)), so relative positions, and therefore attention, are unchanged.

The sink (the character's reference frame) trails the newest frame at a fixed
temporal distance, the relation the model is trained with. Its keys are kept
un-rotated in full precision and re-derived each step (rotate, quantise, write), so
no rounding accumulates in them however long the session runs.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

from engine import fp8
from engine.config import ModelSpec
from engine.rope import (
    apply_rope,
    cos_sin,
    frame_positions,
    reference_positions,
    rope_angles,
    temporal_delta_angles,
)

KV_DTYPES = {"fp8": fp8.FP8, "bf16": torch.bfloat16, "fp32": torch.float32}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Plain attention: q (H, N, D) over k, v (H, S, D); `valid` (S,) masks empty slots."""
    mask = None if valid is None else valid.view(1, 1, -1)
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask)[0]


class TokenRope:
    """cos/sin of a frame's tokens and the reference's tokens at any temporal position."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str):
        self.spec, self.dtype, self.device = spec, dtype, device
        self.frame_rows, self.frame_cols = frame_positions(spec)
        self.ref_rows, self.ref_cols = reference_positions(spec)

    def frame(self, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        angles = rope_angles(self.spec, torch.full_like(self.frame_rows, t), self.frame_rows, self.frame_cols)
        return cos_sin(angles, self.dtype, self.device)

    def reference(self, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        angles = rope_angles(self.spec, torch.full_like(self.ref_rows, t), self.ref_rows, self.ref_cols)
        return cos_sin(angles, self.dtype, self.device)


class RingKVCache:
    """Per-layer ring: `sink_slots` reference slots, then `window_frames` frame slots.

    K is stored rotated (RoPE at write time) and, with kv_dtype="fp8", quantised with
    static per-head scales; reading needs no reordering because attention is order-free
    once positions are baked in, only a mask for slots not yet written.
    """

    def __init__(
        self,
        spec: ModelSpec,
        k_gains: list[torch.Tensor],
        v_gains: list[torch.Tensor],
        *,
        kv_dtype: str = "fp8",
        reset_every: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.kv_dtype = kv_dtype
        self.reset_every = spec.reset_every if reset_every is None else reset_every
        if self.reset_every < 0:
            raise ValueError(f"reset_every must be >= 0 (0 = never), got {self.reset_every}")
        L, H, D, S = spec.n_blocks, spec.n_heads, spec.head_dim, spec.cache_slots
        store = KV_DTYPES[kv_dtype]
        self.k = torch.zeros(L, H, S, D, dtype=store, device=self.device)  # (L, H, S, D)
        self.v = torch.zeros(L, H, S, D, dtype=store, device=self.device)
        if kv_dtype == "fp8":
            self.k_scale = torch.stack([fp8.per_head_scale(g) for g in k_gains]).to(self.device)  # (L, H)
            self.v_scale = torch.stack([fp8.per_head_scale(g) for g in v_gains]).to(self.device)
        else:
            self.k_scale = self.v_scale = None
        self.sink_k = torch.zeros(L, H, spec.reference_tokens, D, dtype=torch.float32, device=self.device)
        self.valid = torch.zeros(S, dtype=torch.bool, device=self.device)
        self.rope = TokenRope(spec, dtype, self.device)
        self._reset_cos, self._reset_sin = cos_sin(temporal_delta_angles(spec, -self.reset_every), torch.float32, self.device)
        self.step = -1
        self.position = 0  # temporal position of the newest frame
        self.resets = 0

    # Storage helpers ----------------------------------------------------------
    def _store(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return fp8.quantize(x, scale) if scale is not None else x.to(self.k.dtype)

    def _load(self, x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return fp8.dequantize(x, scale, dtype) if scale is not None else x.to(dtype)

    def _scale(self, scales: torch.Tensor | None, layer: int) -> torch.Tensor | None:
        return None if scales is None else scales[layer]

    def frame_slot(self, step: int) -> int:
        return self.spec.sink_slots + (step % self.spec.window_frames) * self.spec.frame_tokens

    # Session lifecycle ---------------------------------------------------------
    def reference_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Reference tokens attend among themselves; their K (un-rotated) and V become the sink."""
        n = self.spec.reference_tokens
        self.sink_k[layer] = k.float()
        self.v[layer, :, :n] = self._store(v, self._scale(self.v_scale, layer))
        self.valid[:n] = True
        cos, sin = self.rope.reference(0.0)
        return attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)

    def begin_step(self, step: int) -> None:
        """Advance to `step`: reset positions if due, then re-derive the sink's keys."""
        if step != self.step + 1:
            raise ValueError(f"steps must advance one at a time: expected {self.step + 1}, got {step}")
        self.step = step
        if step == 0:
            self.position = self.spec.sink_distance
        else:
            self.position += 1
            if self.reset_every and step % self.reset_every == 0:
                self.rotate_window()
        self.write_sink_keys()

    def rotate_window(self) -> None:
        """Position reset: every cached frame key moves back `reset_every` frames in one rotation."""
        ring = slice(self.spec.sink_slots, self.spec.cache_slots)
        for layer in range(self.spec.n_blocks):
            scale = self._scale(self.k_scale, layer)
            k = self._load(self.k[layer, :, ring], scale, torch.float32)
            self.k[layer, :, ring] = self._store(apply_rope(k, self._reset_cos, self._reset_sin), scale)
        self.position -= self.reset_every
        self.resets += 1

    def write_sink_keys(self) -> None:
        n = self.spec.reference_tokens
        cos, sin = self.rope.reference(float(self.position - self.spec.sink_distance))
        cos, sin = cos.float(), sin.float()
        for layer in range(self.spec.n_blocks):
            self.k[layer, :, :n] = self._store(apply_rope(self.sink_k[layer], cos, sin), self._scale(self.k_scale, layer))

    def end_step(self) -> None:
        pass  # the last pass's K/V already sits in the frame's slot

    # Per pass ----------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """RoPE + quantise the newest frame's K/V (H, F, D) into its ring slot."""
        start = self.frame_slot(self.step)
        end = start + self.spec.frame_tokens
        cos, sin = self._frame_cos_sin()
        self.k[layer, :, start:end] = self._store(apply_rope(k, cos, sin), self._scale(self.k_scale, layer))
        self.v[layer, :, start:end] = self._store(v, self._scale(self.v_scale, layer))
        self.valid[start:end] = True

    def read(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self._load(self.k[layer], self._scale(self.k_scale, layer), dtype),
            self._load(self.v[layer], self._scale(self.v_scale, layer), dtype),
        )

    def _frame_cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self, "_cs_position", None) != self.position:
            self._cs = self.rope.frame(float(self.position))
            self._cs_position = self.position
        return self._cs

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write(layer, k, v)
        cos, sin = self._frame_cos_sin()
        k_all, v_all = self.read(layer, q.dtype)
        return attention(apply_rope(q, cos, sin), k_all, v_all, self.valid)


class ReferenceKVCache:
    """The oracle: full-precision un-rotated K/V per frame, concatenated and rotated at read time.

    No ring, no quantisation, no position reset: the naive way every optimisation is
    held against.
    """

    def __init__(self, spec: ModelSpec, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.rope = TokenRope(spec, dtype, self.device)
        self.sink: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * spec.n_blocks
        self.history: deque[list[tuple[torch.Tensor, torch.Tensor]]] = deque(maxlen=max(spec.window_frames - 1, 0))
        self.pending: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * spec.n_blocks
        self.step = -1

    def position(self, step: int) -> int:
        return self.spec.sink_distance + step

    def reference_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.sink[layer] = (k, v)
        cos, sin = self.rope.reference(0.0)
        return attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)

    def begin_step(self, step: int) -> None:
        if step != self.step + 1:
            raise ValueError(f"steps must advance one at a time: expected {self.step + 1}, got {step}")
        self.step = step

    def gather(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenate sink + window + newest frame, rotating every key at read time."""
        sink_k, sink_v = self.sink[layer]
        now = self.position(self.step)
        keys = [apply_rope(sink_k, *self.rope.reference(float(now - self.spec.sink_distance)))]
        values = [sink_v]
        first = self.step - len(self.history)
        for i, frame in enumerate(self.history):
            fk, fv = frame[layer]
            keys.append(apply_rope(fk, *self.rope.frame(float(self.position(first + i)))))
            values.append(fv)
        keys.append(apply_rope(k, *self.rope.frame(float(now))))
        values.append(v)
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pending[layer] = (k, v)
        k_all, v_all = self.gather(layer, k, v)
        q = apply_rope(q, *self.rope.frame(float(self.position(self.step))))
        return attention(q, k_all, v_all)

    def end_step(self) -> None:
        if self.spec.window_frames > 1:
            self.history.append(list(self.pending))
        self.pending = [None] * self.spec.n_blocks
