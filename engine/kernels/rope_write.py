"""Write-time cache kernels: RoPE + FP8 quantisation + ring store, and the reset's delta rotation.

`write_frame`   one launch per attention call: optionally RMS-normalises each head of the
                raw q, k, v (the block's norms, with their gains), rotates q and k at
                the current position, quantises q, k, v with per-head scales, stores
                k and v into the frame's ring slot (v transposed, (H, D, S), as the
                FP8 attention kernel's second product wants it), q into a buffer, and
                marks the slot valid. Position and slot come from device tensors so a
                CUDA graph can replay it at every step.
`rope_store`    rotates + quantises float keys into cache rows (the sink, re-derived each step).
`delta_rotate`  the position reset: rotates the temporal pairs of every ring key in
                place, re-rounding with the scale it was stored with.

Pairs are adjacent dims (2j, 2j+1), as in engine/rope.py; cos/sin tables are
(positions, tokens, D/2) float32, indexed by a device position index.

`write_frame` stays a kernel of its own rather than the q/k/v GEMM's epilogue: the most that fusion could save
(the step with no frame write at all) is small next to the cost of the epilogue's norms, rotation and V's
transposed store (docs/kernels.md). On the CPU the kernels run under TRITON_INTERPRET=1.

The PyTorch reference is the ring cache's torch backend, engine/cache.py's RingKVCache: `write` (with
engine/model.py's `apply_head_norm` and engine/rope.py's `apply_rope`) for `write_frame`, its sink path in
`write_sink_keys` for `rope_store`, and `rotate_window` for `delta_rotate`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import round_to, to_fp8, wait_for_previous_kernel
from engine.kernels.launch import FP_FUSION, interpreting, pdl_launch


@triton.jit
def _load_rows(src, s_tok, tok, t_ok, gain, eps, D: tl.constexpr, NORM: tl.constexpr, EXACT: tl.constexpr):
    """Rows `tok` of src (tokens, D) in float32; with NORM, RMS-normalised with gain (D,)."""
    d = tl.arange(0, D)
    x = tl.load(src + tok[:, None] * s_tok + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)  # one contiguous row read
    if NORM:
        x = x / tl.sqrt(tl.sum(x * x, 1) / D + eps)[:, None] * tl.load(gain + d)[None, :].to(tl.float32)
        x = round_to(x, src.dtype.element_ty, EXACT)  # rounded as the model's norm stores it (bf16 on a GPU)
    return x


@triton.jit
def _rotate_quant(x, c, s, scale, EXACT: tl.constexpr):
    """Rows x (BLOCK_T, D) rotated by cos/sin (BLOCK_T, D/2) and quantised: e4m3, pairs interleaved as stored."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
    return to_fp8(tl.interleave((a * c - b * s) / scale, (a * s + b * c) / scale), EXACT)


@triton.jit
def _angles(cos_base, sin_base, tok, t_ok, D: tl.constexpr):
    """cos and sin (BLOCK_T, D/2) of tokens `tok` from one position's tables (tokens, D/2)."""
    HALF: tl.constexpr = D // 2
    cs = tok[:, None] * HALF + tl.arange(0, HALF)[None, :]
    return tl.load(cos_base + cs, mask=t_ok[:, None], other=1.0), tl.load(sin_base + cs, mask=t_ok[:, None], other=0.0)


@triton.jit
def _write_frame_kernel(
    q, k, v, s_qh, s_qt, s_kh, s_kt, s_vh, s_vt,  # inputs (H, F, D), last dim contiguous
    cos, sin, pos_idx, slot,  # tables (P, F, D/2); device scalars
    q8, k_cache, vt_cache, valid,  # (H, F, D), (H, S, D), (H, D, S), (S,)
    q_scale, k_scale, v_scale,  # (H,)
    gains, eps,  # (3, H, D): q, k, v norm gains, read with NORM
    F, S, H,
    D: tl.constexpr, BLOCK_T: tl.constexpr, EXACT: tl.constexpr, NORM: tl.constexpr, PV_ORDER: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pid_t, h = tl.program_id(0), tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tok < F
    table = tl.load(pos_idx) * F * (D // 2)
    start = tl.load(slot)
    d = tl.arange(0, D)
    m = t_ok[:, None]
    # Every read first, then the arithmetic and the stores: the three row loads are in flight together
    # (a store between them would keep the compiler from hoisting the later loads above it).
    xq = _load_rows(q + h * s_qh, s_qt, tok, t_ok, gains + h * D, eps, D, NORM, EXACT)
    xk = _load_rows(k + h * s_kh, s_kt, tok, t_ok, gains + (H + h) * D, eps, D, NORM, EXACT)
    if PV_ORDER:  # V's columns where the ws attention kernel reads them (fp8_attention_ws.pv_slot_order):
        # this program stores the contiguous columns of one block from the frame's first 16-aligned column and
        # gathers the tokens whose V goes there (whole rows, still contiguous reads), so the stores stay coalesced
        col = (start & -16) + pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        v_slot = (col & -16) | (((col >> 1) & 1) << 3) | (((col >> 3) & 1) << 2) | (((col >> 2) & 1) << 1) | (col & 1)
        v_tok = v_slot - start
        v_ok = (v_tok >= 0) & (v_tok < F)
    else:
        col, v_tok, v_ok = start + tok, tok, t_ok
    xv = _load_rows(v + h * s_vh, s_vt, v_tok, v_ok, gains + (2 * H + h) * D, eps, D, NORM, EXACT)
    c, s = _angles(cos + table, sin + table, tok, t_ok, D)  # shared by q and k
    tl.store(q8 + h * F * D + tok[:, None] * D + d[None, :], _rotate_quant(xq, c, s, tl.load(q_scale + h), EXACT), mask=m)
    tl.store(k_cache + h * S * D + (start + tok)[:, None] * D + d[None, :], _rotate_quant(xk, c, s, tl.load(k_scale + h), EXACT),
             mask=m)
    # v goes to the transposed cache: store the (D, BLOCK_T) transpose so writes run along slots
    v8 = tl.trans(to_fp8(xv / tl.load(v_scale + h), EXACT))
    tl.store(vt_cache + h * D * S + d[:, None] * S + col[None, :], v8, mask=v_ok[None, :])
    if h == 0:
        tl.store(valid + start + tok, tl.full((BLOCK_T,), 1, tl.int8), mask=t_ok)


def write_frame(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos_idx: torch.Tensor, slot: torch.Tensor, q8: torch.Tensor, k_cache: torch.Tensor,
                vt_cache: torch.Tensor, valid: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
                v_scale: torch.Tensor, head_norm: tuple[torch.Tensor, float] | None = None, block_t: int = 16,
                num_warps: int = 8, pv_order: bool = False) -> None:
    """q, k, v (H, F, D) -> q8 (H, F, D), k_cache (H, S, D) and vt_cache (H, D, S) rows/cols at `slot`.

    With `head_norm` ((3, H, D) gains of q, k, v; eps), q, k, v are raw projections (any strides with a
    contiguous last dim, e.g. views of the (F, 3*H*D) QKV output) and get their per-head RMS norms here.
    Small token blocks (16 rows, 8 warps) keep more rows in flight across the SMs than blocks of 64
    (docs/kernels.md).
    With `pv_order`, V's slots go where the warp-specialised attention kernel reads them
    (fp8_attention_ws.pv_slot_order): one more token block per head, as the blocks of V's columns start at the
    frame's first 16-aligned slot; block_t a multiple of 16."""
    H, F, D = k.shape
    S = k_cache.shape[1]
    for x in (q, k, v):
        assert x.stride(-1) == 1, "q, k, v need a contiguous last dim"
    gains, eps = head_norm if head_norm is not None else (q_scale, 0.0)  # q_scale: any pointer, unread without NORM
    if head_norm is not None:
        assert gains.shape == (3, H, D) and gains.is_contiguous(), "head_norm gains must be a contiguous (3, H, D)"
    if pv_order and block_t % 16:
        raise ValueError(f"pv_order needs block_t a multiple of 16 (V's slots are reordered within groups of 16), got {block_t}")
    grid = (triton.cdiv(F + (15 if pv_order else 0), block_t), H)
    pdl, pdl_kw = pdl_launch(q.device)
    _write_frame_kernel[grid](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos, sin, pos_idx, slot, q8, k_cache, vt_cache, valid, q_scale, k_scale, v_scale, gains, eps, F, S, H,
        D=D, BLOCK_T=block_t, EXACT=interpreting(), NORM=head_norm is not None, PV_ORDER=pv_order, PDL=pdl,
        num_warps=num_warps, **FP_FUSION, **pdl_kw,
    )


@triton.jit
def _rope_store_kernel(src, cos, sin, pos_idx, dst, scale, N, S, D: tl.constexpr, BLOCK_T: tl.constexpr, EXACT: tl.constexpr):
    pid_t, r = tl.program_id(0), tl.program_id(1)  # r: a (layer, head) row of the cache
    r = r.to(tl.int64)  # every layer's rows: past 2^31 elements at tensor-parallel degree 1 (60 x 60 x 5824 x 128)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tok < N
    table = tl.load(pos_idx) * N * (D // 2)
    x = _load_rows(src + r * N * D, D, tok, t_ok, scale, 0.0, D, False, EXACT)
    c, s = _angles(cos + table, sin + table, tok, t_ok, D)
    rot = _rotate_quant(x, c, s, tl.load(scale + r), EXACT)
    d = tl.arange(0, D)
    tl.store(dst + r * S * D + tok[:, None] * D + d[None, :], rot, mask=t_ok[:, None])


def rope_store(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos_idx: torch.Tensor,
               dst: torch.Tensor, scale: torch.Tensor, block_t: int = 32) -> None:
    """src (R, N, D) float, contiguous -> dst (R, S, D) e4m3 rows 0..N-1; scale (R,); tables (P, N, D/2)."""
    R, N, D = src.shape
    assert src.is_contiguous() and dst.is_contiguous()
    grid = (triton.cdiv(N, block_t), R)
    _rope_store_kernel[grid](src, cos, sin, pos_idx, dst, scale, N, dst.shape[1], D=D, BLOCK_T=block_t, EXACT=interpreting(),
                             **FP_FUSION)


@triton.jit
def _delta_rotate_kernel(cache, cos, sin, scale, first, S, D: tl.constexpr, PAIRS: tl.constexpr, PAIRS_P2: tl.constexpr,
                         BLOCK_T: tl.constexpr, EXACT: tl.constexpr):
    pid_t, r = tl.program_id(0), tl.program_id(1)
    r = r.to(tl.int64)  # as in _rope_store_kernel: offsets into every layer's rows overflow int32
    tok = first + pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, 2 * PAIRS_P2)  # the temporal pairs lead each row
    m = (tok < S)[:, None] & (d < 2 * PAIRS)[None, :]
    sc = tl.load(scale + r)
    ptr = cache + r * S * D + tok[:, None] * D + d[None, :]
    x = tl.load(ptr, mask=m, other=0.0).to(tl.float32) * sc
    j = tl.arange(0, PAIRS_P2)
    c = tl.load(cos + j, mask=j < PAIRS, other=1.0)[None, :]
    s = tl.load(sin + j, mask=j < PAIRS, other=0.0)[None, :]
    tl.store(ptr, _rotate_quant(x, c, s, sc, EXACT), mask=m)


def delta_rotate(cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor, first: int,
                 block_t: int = 64) -> None:
    """Rotate rows first..S-1 of cache (R, S, D) e4m3 in place by the temporal angles (P,) (P pairs)."""
    R, S, D = cache.shape
    pairs = cos.numel()
    grid = (triton.cdiv(S - first, block_t), R)
    _delta_rotate_kernel[grid](cache, cos, sin, scale, first, S, D=D, PAIRS=pairs,
                               PAIRS_P2=triton.next_power_of_2(pairs), BLOCK_T=block_t, EXACT=interpreting(), **FP_FUSION)
