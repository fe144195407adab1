"""KV caches: the ring (the serving path) and the plain reference (the oracle).

Both give the model the same `attend(layer, q, k, v, head_norm=None, fp8_out=False)` and
`reference_attend(...)`, take un-rotated per-head q, k, v (H, N, D) of the newest frame
(raw projections with their norm gains when `head_norm` is given), and agree on what
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
from engine.kernels import attention_kernel, make_attention
from engine.model import HeadNorm, apply_head_norm
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
    """Plain attention: q (H, N, D) over k, v (H, S, D); `valid` (S,) masks empty slots. q and k are taken in
    v's dtype: rotated by float32 tables, they come back float32 where a float32 model's FP8 linears gave bf16."""
    mask = None if valid is None else valid.view(1, 1, -1)
    q, k = q.to(v.dtype), k.to(v.dtype)
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask)[0]


def check_next_step(current: int, step: int) -> None:
    if step != current + 1:
        raise ValueError(f"steps must advance one at a time: expected {current + 1}, got {step}")


def reference_self_attention(rope: "TokenRope", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference's tokens attend among themselves (all at one temporal position)."""
    cos, sin = rope.reference(0.0)
    return attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)


class TokenRope:
    """cos/sin of a frame's tokens and the reference's tokens at any temporal position."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, keep: int = 64):
        self.spec, self.dtype, self.device = spec, dtype, device
        self.keep = keep  # tables kept, oldest dropped first: a ring's positions repeat every reset period
        self.frame_rows, self.frame_cols = frame_positions(spec)
        self.ref_rows, self.ref_cols = reference_positions(spec)
        self._recent: dict[tuple[str, float], tuple[torch.Tensor, torch.Tensor]] = {}

    def frame(self, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._table("frame", t, self.frame_rows, self.frame_cols)

    def reference(self, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._table("reference", t, self.ref_rows, self.ref_cols)

    def _table(self, kind: str, t: float, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at temporal position t, kept for the last few positions asked for."""
        key = (kind, t)
        if key not in self._recent:
            if len(self._recent) >= self.keep:
                self._recent.pop(next(iter(self._recent)))
            self._recent[key] = cos_sin(rope_angles(self.spec, torch.full_like(rows, t), rows, cols), self.dtype, self.device)
        return self._recent[key]


class RingKVCache:
    """Per-layer ring: `sink_slots` reference slots, then `window_frames` frame slots.

    K is stored rotated (RoPE at write time) and, with kv_dtype="fp8", quantised with
    static per-head scales; reading needs no reordering because attention is order-free
    once positions are baked in, only a mask for slots not yet written. V is stored
    transposed, (L, H, D, S), the operand layout FP8 tensor cores take for P·V; for the
    warp-specialised attention kernel its slots are also reordered within groups of 16
    (`v_positions`) into the order that kernel's P·V reads them in.

    backend="torch" runs every piece in PyTorch (any device); backend="triton" (FP8 on
    a CUDA GPU, or under the Triton interpreter) uses one kernel per attention call
    for RoPE + quantise + ring write, one for the sink, one for the reset rotation,
    and the FP8 attention kernel; positions and slots then live in device tensors so a
    CUDA graph can replay the passes.
    """

    def __init__(
        self,
        spec: ModelSpec,
        k_gains: list[torch.Tensor],
        v_gains: list[torch.Tensor],
        *,
        q_gains: list[torch.Tensor] | None = None,
        kv_dtype: str = "fp8",
        reset_every: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str = "torch",
        attention_options: dict | None = None,
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.kv_dtype, self.backend = kv_dtype, backend
        self.reset_every = spec.reset_interval(reset_every)
        if self.reset_every < 0:
            raise ValueError(f"reset_every must be >= 0 (0 = never), got {self.reset_every}")
        # Slots are allocated in multiples of 64 (padding stays masked) so every row of the
        # transposed V cache starts 16-byte aligned, as vector loads and tensor cores want.
        L, H, D, S = len(k_gains), k_gains[0].shape[0], spec.head_dim, -(-spec.cache_slots // 64) * 64
        self.n_layers, self.n_heads = L, H
        store = KV_DTYPES[kv_dtype]
        self.k = torch.zeros(L, H, S, D, dtype=store, device=self.device)  # (L, H, S, D)
        self.vt = torch.zeros(L, H, D, S, dtype=store, device=self.device)  # (L, H, D, S)
        if kv_dtype == "fp8":
            self.k_scale = torch.stack([fp8.per_head_scale(g) for g in k_gains]).to(self.device)  # (L, H)
            self.v_scale = torch.stack([fp8.per_head_scale(g) for g in v_gains]).to(self.device)
        else:
            self.k_scale = self.v_scale = None
        self.sink_k = torch.zeros(L, H, spec.reference_tokens, D, dtype=torch.float32, device=self.device)
        self.valid = torch.zeros(S, dtype=torch.int8, device=self.device)
        # one reset period asks for reset_every frame positions and as many reference ones: all kept, none rebuilt
        self.rope = TokenRope(spec, dtype, self.device, keep=max(64, 2 * self.reset_every + 2))
        self._reset_cos, self._reset_sin = cos_sin(temporal_delta_angles(spec, -self.reset_every), torch.float32, self.device)
        self.step = -1
        self.position = 0  # temporal position of the newest frame
        self.resets = 0
        # The column of vt holding each slot's V, for a kernel that reads V's slots reordered (None: slot j at column j)
        self.v_positions: torch.Tensor | None = None
        if backend == "triton":
            self._init_triton(q_gains, attention_options or {})

    def _init_triton(self, q_gains: list[torch.Tensor] | None, attention_options: dict) -> None:
        from engine.kernels.fp8_attention import out_scale, qk_scale  # Triton, an optional dependency: triton backend only

        s, H, D = self.spec, self.n_heads, self.spec.head_dim
        if self.kv_dtype != "fp8" or q_gains is None:
            raise ValueError("the triton backend needs kv_dtype='fp8' and the q norm gains")
        if not self.reset_every:
            raise ValueError("the triton backend keeps positions in a table and needs reset_every > 0")
        # Positions of the newest frame run sink_distance .. sink_distance + reset_every - 1;
        # the sink sits sink_distance behind it, at 0 .. reset_every - 1. Index = position - sink_distance.
        P = self.reset_every
        frames = torch.stack([torch.stack(self.rope.frame(float(s.sink_distance + i))) for i in range(P)])
        refs = torch.stack([torch.stack(self.rope.reference(float(i))) for i in range(P)])
        as_table = lambda t: t.to(device=self.device, dtype=torch.float32).contiguous()
        self._frame_cos, self._frame_sin = as_table(frames[:, 0]), as_table(frames[:, 1])  # (P, F, D/2)
        self._ref_cos, self._ref_sin = as_table(refs[:, 0]), as_table(refs[:, 1])  # (P, Nr, D/2)
        pairs = s.rope_dims[0] // 2  # the reset rotates temporal pairs only
        self._reset_cos_t = self._reset_cos[:pairs].contiguous()
        self._reset_sin_t = self._reset_sin[:pairs].contiguous()
        self.pos_idx = torch.zeros((), dtype=torch.int32, device=self.device)
        self.slot = torch.zeros((), dtype=torch.int32, device=self.device)
        self.q_scale = torch.stack([fp8.per_head_scale(g) for g in q_gains]).to(self.device)
        self.qk_scale = qk_scale(self.q_scale, self.k_scale, D)  # (L, H)
        self.q8 = torch.empty(H, s.frame_tokens, D, dtype=fp8.FP8, device=self.device)
        self.out = torch.empty(s.frame_tokens, H * D, dtype=torch.bfloat16, device=self.device)
        # The e4m3 output (`attend(..., fp8_out=True)`): one scale per layer that never saturates, the same
        # on every row (the out-projection's row scales), and V's scales in the output's units.
        S = self.k.shape[2]
        o_scale = out_scale(self.v_scale, S)  # (L,)
        self.out8 = torch.empty(s.frame_tokens, H * D, dtype=fp8.FP8, device=self.device)
        rows = -(-s.frame_tokens // 16) * 16  # each layer's scales 64-byte aligned, as cuBLASLt wants them
        self.out8_rows_scale = o_scale.view(-1, 1, 1).expand(-1, rows, 1).contiguous()[:, : s.frame_tokens]  # (L, F, 1)
        self.v_scale_out8 = (self.v_scale / o_scale[:, None]).contiguous()  # (L, H)
        options = dict(attention_options)
        kernel = options.pop("kernel", "auto")
        if kernel == "auto" and options:  # tile options differ between the kernels
            raise ValueError(f"attention options {sorted(options)} need the kernel they are for: add \"kernel\": \"triton\" or \"ws\"")
        self.attention_kernel = attention_kernel(kernel, self.device, D)
        if self.attention_kernel == "ws":  # the served configuration, changed only where the options say
            from engine.kernels.fp8_attention_ws import SERVED_OPTIONS  # Triton (Gluon): the ws kernel only

            options = {**SERVED_OPTIONS, **options}
        self.attention_options = options  # the kernel's own options as launched (the launcher's defaults for the rest)
        self.attention = make_attention(self.attention_kernel, H, s.frame_tokens, self.k.shape[2], D, self.device, **options)
        if self.attention.permutes_v_slots:
            from engine.kernels.fp8_attention_ws import pv_slot_order  # Triton (Gluon): the ws kernel only

            self.v_positions = torch.argsort(pv_slot_order(self.k.shape[2])).to(self.device)
        self.rotate_window(count=False)  # compiles the rotation now (zeros stay zeros), not in the first reset step

    # Storage helpers ----------------------------------------------------------
    def _store(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return fp8.quantize(x, scale) if scale is not None else x.to(self.k.dtype)

    def _load(self, x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return fp8.dequantize(x, scale, dtype) if scale is not None else x.to(dtype)

    def _scale(self, scales: torch.Tensor | None, layer: int) -> torch.Tensor | None:
        return None if scales is None else scales[layer]

    def _v_columns(self, start: int, end: int) -> slice | torch.Tensor:
        """Where slots start..end-1 sit along vt's slot axis."""
        return slice(start, end) if self.v_positions is None else self.v_positions[start:end]

    def vt_in_slot_order(self) -> torch.Tensor:
        """vt (L, H, D, S) with slot j at column j, however the attention kernel has it stored: the cache itself
        when in that order, else a reordered copy (to read; writes to it do not reach the cache)."""
        return self.vt if self.v_positions is None else self.vt[..., self.v_positions]

    def frame_slot(self, step: int) -> int:
        return self.spec.sink_slots + (step % self.spec.window_frames) * self.spec.frame_tokens

    # Session lifecycle ---------------------------------------------------------
    def reference_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         head_norm: HeadNorm | None = None, fp8_out: bool = False) -> torch.Tensor:
        """Reference tokens attend among themselves; their K (un-rotated) and V become the sink."""
        q, k, v = apply_head_norm(q, k, v, head_norm)
        n = self.spec.reference_tokens
        self.sink_k[layer] = k.float()
        self.vt[layer, :, :, self._v_columns(0, n)] = self._store(v, self._scale(self.v_scale, layer)).transpose(-1, -2)
        self.valid[:n] = 1
        return reference_self_attention(self.rope, q, k, v)

    def begin_step(self, step: int, write_sink: bool = True) -> None:
        """Advance to `step`: reset positions if due, then re-derive the sink's keys (unless `write_sink` is
        False: a session whose CUDA graph writes them, from the device positions set here, calls
        write_sink_keys inside it)."""
        check_next_step(self.step, step)
        self.step = step
        if step == 0:
            self.position = self.spec.sink_distance
        else:
            self.position += 1
            if self.reset_every and step % self.reset_every == 0:
                self.rotate_window()
        if self.backend == "triton":
            self.pos_idx.fill_(self.position - self.spec.sink_distance)
            self.slot.fill_(self.frame_slot(step))
            if step <= self.spec.window_frames:  # once the window has filled, no slot turns live any more
                self.attention.mark_live_tiles(self.valid)
        if write_sink:
            self.write_sink_keys()

    def rotate_window(self, count: bool = True) -> None:
        """Position reset: every cached frame key moves back `reset_every` frames in one rotation."""
        first = self.spec.sink_slots
        if self.backend == "triton":
            from engine.kernels.rope_write import delta_rotate  # Triton, an optional dependency: triton backend only

            L, H, S, D = self.k.shape
            delta_rotate(self.k.view(L * H, S, D), self._reset_cos_t, self._reset_sin_t, self.k_scale.view(-1), first)
        else:
            for layer in range(self.n_layers):
                scale = self._scale(self.k_scale, layer)
                k = self._load(self.k[layer, :, first:], scale, torch.float32)
                self.k[layer, :, first:] = self._store(apply_rope(k, self._reset_cos, self._reset_sin), scale)
        if count:
            self.position -= self.reset_every
            self.resets += 1

    def write_sink_keys(self) -> None:
        n = self.spec.reference_tokens
        if self.backend == "triton":
            from engine.kernels.rope_write import rope_store  # Triton, an optional dependency: triton backend only

            L, H, S, D = self.k.shape
            rope_store(self.sink_k.view(L * H, n, D), self._ref_cos, self._ref_sin, self.pos_idx,
                       self.k.view(L * H, S, D), self.k_scale.view(-1))
            return
        cos, sin = self.rope.reference(float(self.position - self.spec.sink_distance))
        cos, sin = cos.float(), sin.float()
        for layer in range(self.n_layers):
            self.k[layer, :, :n] = self._store(apply_rope(self.sink_k[layer], cos, sin), self._scale(self.k_scale, layer))

    def end_step(self) -> None:
        pass  # the last pass's K/V already sits in the frame's slot

    # Per pass ----------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """RoPE + quantise the newest frame's K/V (H, F, D) into its ring slot (torch backend)."""
        start = self.frame_slot(self.step)
        end = start + self.spec.frame_tokens
        cos, sin = self._frame_cos_sin()
        self.k[layer, :, start:end] = self._store(apply_rope(k, cos, sin), self._scale(self.k_scale, layer))
        self.vt[layer, :, :, self._v_columns(start, end)] = self._store(v, self._scale(self.v_scale, layer)).transpose(-1, -2)
        self.valid[start:end] = 1

    def read(self, layer: int, dtype: torch.dtype, slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised K, V (H, S, D) of a layer (the first `slots` slots only, when given)."""
        n = self.k.shape[2] if slots is None else slots
        return (
            self._load(self.k[layer, :, :n], self._scale(self.k_scale, layer), dtype),
            self._load(self.vt[layer, :, :, self._v_columns(0, n)], self._scale(self.v_scale, layer), dtype).transpose(-1, -2),
        )

    def live_prefix(self) -> int | None:
        """n when slots [0, n) are exactly the live ones (known on the host from the step count), so
        attention can read that slice unmasked; None when the live slots have holes (sink padding)."""
        s = self.spec
        if s.reference_tokens != s.sink_slots or self.step < 0:
            return None
        return s.sink_slots + min(self.step + 1, s.window_frames) * s.frame_tokens

    def _frame_cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.frame(float(self.position))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               head_norm: HeadNorm | None = None, fp8_out: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(H, N, D); with `fp8_out` the triton backend returns (e4m3 (N, H*D), its row scales (N, 1)) instead,
        as the out-projection's FP8 GEMM reads them (the other backend gives (H, N, D) regardless)."""
        if self.backend == "triton":
            return self._attend_triton(layer, q, k, v, head_norm, fp8_out)
        q, k, v = apply_head_norm(q, k, v, head_norm)
        self.write(layer, k, v)
        cos, sin = self._frame_cos_sin()
        # SDPA takes its fused kernels only without a mask and with V's rows contiguous (the ring
        # stores V transposed for the Triton kernels): slice the live prefix, copy V into rows.
        live = self.live_prefix()
        k_all, v_all = self.read(layer, q.dtype, live)
        return attention(apply_rope(q, cos, sin), k_all, v_all.contiguous(), None if live is not None else self.valid.bool())

    def _attend_triton(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       head_norm: HeadNorm | None = None,
                       fp8_out: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from engine.kernels.rope_write import write_frame  # Triton, an optional dependency: triton backend only

        write_frame(q, k, v, self._frame_cos, self._frame_sin, self.pos_idx, self.slot, self.q8,
                    self.k[layer], self.vt[layer], self.valid, self.q_scale[layer], self.k_scale[layer], self.v_scale[layer],
                    head_norm=head_norm, pv_order=self.v_positions is not None)
        if fp8_out:
            self.attention(self.q8, self.k[layer], self.vt[layer], self.valid, self.qk_scale[layer],
                           self.v_scale_out8[layer], self.out8)
            return self.out8, self.out8_rows_scale[layer]
        self.attention(self.q8, self.k[layer], self.vt[layer], self.valid, self.qk_scale[layer], self.v_scale[layer], self.out)
        H, D = self.n_heads, self.spec.head_dim
        return self.out.view(-1, H, D).transpose(0, 1).to(q.dtype)  # (H, F, D) view of (F, H*D)


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

    def reference_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         head_norm: HeadNorm | None = None, fp8_out: bool = False) -> torch.Tensor:
        q, k, v = apply_head_norm(q, k, v, head_norm)
        self.sink[layer] = (k, v)
        return reference_self_attention(self.rope, q, k, v)

    def begin_step(self, step: int) -> None:
        check_next_step(self.step, step)
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

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               head_norm: HeadNorm | None = None, fp8_out: bool = False) -> torch.Tensor:
        """(H, N, D), whatever `fp8_out` asks (the ring's triton backend alone answers it)."""
        q, k, v = apply_head_norm(q, k, v, head_norm)
        self.pending[layer] = (k, v)
        k_all, v_all = self.gather(layer, k, v)
        q = apply_rope(q, *self.rope.frame(float(self.position(self.step))))
        return attention(q, k_all, v_all)

    def end_step(self) -> None:
        if self.spec.window_frames > 1:
            self.history.append(list(self.pending))
        self.pending = [None] * self.spec.n_blocks
