"""FP8 attention over the ring cache, with per-head scales (Hopper: e4m3 tensor cores).

Reads q (H, M, D), the cache's K (H, S, D) and V stored transposed (H, D, S), all e4m3
with one scale per head, and a validity byte per slot (empty ring slots and sink
padding are masked). Both products run in FP8: q·kᵀ, and P·V with the probabilities
scaled by 256 before rounding so small ones keep precision. The KV axis can be split
across programs (flash-decoding): a frame's queries make too few query blocks to fill
the SMs, so splits are merged afterwards by their log-sum-exp. At FP8 rates
the softmax's 2^x competes with the products: `exp2` puts it on the special-function unit
("mufu"), on the FMA units ("fma", a polynomial), or half on each ("mixed"). With `tma` the
K and V tiles come through tensor descriptors (Hopper's copy engine) instead of pointer loads.

Output (M, H*D) in the layout the attention's out-projection reads: bf16, or e4m3 when the caller
passes an e4m3 `out` (`out_scale` gives the scale that never saturates), which the out-projection's
FP8 GEMM then reads without a quantisation pass of its own.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels.common import to_fp8
from engine.kernels.launch import FP_FUSION, interpreting

LOG2E = 1.4426950408889634
EXP2_UNITS = ("mufu", "fma", "mixed")


@triton.jit
def _exp2_fma(x):
    """2^x (-inf <= x < 126) on the FMA and integer units instead of the special-function unit, whose
    throughput (16 a clock per SM against 128 FMAs) bounds this kernel's softmax: x = j + f with
    j = round(x) read from the bits of x + 1.5 * 2^23, 2^f by a quadratic (relative error below
    0.2%, far under e4m3's rounding), j added into the exponent bits. -inf gives 0."""
    xc = tl.maximum(x, -125.0)
    r = xc + 12582912.0
    f = xc - (r - 12582912.0)  # in [-0.5, 0.5]
    p = (0.23840743 * f + 0.70340618) * f + 1.00044142
    bits = p.to(tl.int32, bitcast=True) + (r.to(tl.int32, bitcast=True) << 23)
    return tl.where(x == float("-inf"), 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def _attn_kernel(
    q, k, vt, valid, qk_scale, v_scale,  # (H, M, D), (H, S, D), (H, D, S), (S,), (H,), (H,)
    k_desc, vt_desc,  # with TMA: descriptors of k as (H*S, D) and vt as (H*D, S); else unused
    out, s_om, s_oh,  # (M, H*D) bf16 or e4m3 when SPLITS == 1
    part_o, part_m, part_l,  # (SPLITS, H, M, D) f32, (SPLITS, H, M) f32 x2 when SPLITS > 1
    H, M, S, blocks_per_split,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, EXACT: tl.constexpr,
    PV_FP8: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, EXP2_UNIT: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    EVEN_N: tl.constexpr, TMA: tl.constexpr, OUT_FP8: tl.constexpr,
):
    pid_m, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    row_ok = rows < M
    q_blk = tl.load(q + h * M * D + rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    scale = tl.load(qk_scale + h)  # q_scale * k_scale / sqrt(D) * log2(e)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    lo = split * blocks_per_split * BLOCK_N
    for i in tl.range(0, blocks_per_split, warp_specialize=WARP_SPECIALIZE):
        cols = lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
        if EVEN_N:  # the splits tile the slots exactly: no bounds masks in the loop (TMA implies it)
            live = tl.load(valid + cols)
        else:
            col_ok = cols < S
            live = tl.load(valid + cols, mask=col_ok, other=0)
        bias = tl.where(live != 0, 0.0, float("-inf"))
        if TMA:  # the copy engine fetches the tile; with EVEN_N tiles never cross into the next head
            k_blk = k_desc.load([h * S + lo + i * BLOCK_N, 0])
        elif EVEN_N:
            k_blk = tl.load(k + h * S * D + cols[:, None] * D + d[None, :])
        else:
            k_blk = tl.load(k + h * S * D + cols[:, None] * D + d[None, :], mask=col_ok[:, None], other=0.0)
        s = tl.dot(q_blk, tl.trans(k_blk)) * scale + bias[None, :]
        m_blk = tl.max(s, 1)
        if LAZY_RESCALE:
            # Rescale only when some row's maximum grew by more than 0.5 (log2 units); in between the
            # probabilities are taken against the older maximum: at most 2^0.5 * 256 (below), inside
            # e4m3's 448. Most blocks then skip the (BLOCK_M, D) rescale of the accumulator.
            grown = m_blk > m_i
            jump = tl.max(tl.where(grown, m_blk - tl.where(grown, m_i, 0.0), 0.0), 0)  # no -inf - -inf
            if jump > 0.5:
                m_new = tl.maximum(m_i, m_blk)
                alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)  # a row with no live slot yet
        else:
            m_new = tl.maximum(m_i, m_blk)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        # Probabilities against (maximum - 8): scaled by 256 so that small ones keep precision in
        # e4m3; numerator and denominator carry the same factor, which cancels at the end.
        x = s - (m_safe - 8.0)[:, None]
        if EXP2_UNIT == "fma":
            p = _exp2_fma(x)
        elif EXP2_UNIT == "mixed":  # odd columns on the FMA units, even ones on the special-function unit
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_N // 2, 2)))
            p = tl.reshape(tl.join(tl.exp2(x_even), _exp2_fma(x_odd)), (BLOCK_M, BLOCK_N))
        else:
            p = tl.exp2(x)
        l_i = l_i + tl.sum(p, 1)
        if TMA:
            v_blk = vt_desc.load([h * D, lo + i * BLOCK_N])
        elif EVEN_N:
            v_blk = tl.load(vt + h * D * S + d[:, None] * S + cols[None, :])
        else:
            v_blk = tl.load(vt + h * D * S + d[:, None] * S + cols[None, :], mask=col_ok[None, :], other=0.0)
        if PV_FP8:
            acc = tl.dot(to_fp8(p, EXACT), tl.trans(v_blk), acc)
        else:  # P in fp16 against V widened to fp16 (exact for e4m3; P <= 2^8.5 fits): half the rate, less rounding
            acc = tl.dot(p.to(tl.float16), tl.trans(v_blk).to(tl.float16), acc)
    if SPLITS == 1:
        o = acc * tl.load(v_scale + h) / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        _store_out(out + rows[:, None] * s_om + h * s_oh + d[None, :], o, row_ok[:, None], OUT_FP8, EXACT)
    else:
        base = (split * H + h) * M
        tl.store(part_o + (base + rows)[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_m + base + rows, m_i, mask=row_ok)
        tl.store(part_l + base + rows, l_i, mask=row_ok)


@triton.jit
def _store_out(ptrs, o, mask, OUT_FP8: tl.constexpr, EXACT: tl.constexpr):
    if OUT_FP8:
        tl.store(ptrs, to_fp8(o, EXACT), mask=mask)
    else:
        tl.store(ptrs, o.to(tl.bfloat16), mask=mask)


@triton.jit
def _merge_kernel(part_o, part_m, part_l, v_scale, out, s_om, s_oh, H, M,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, OUT_FP8: tl.constexpr,
                  EXACT: tl.constexpr):
    pid_m, h = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    d = tl.arange(0, D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for sp in range(SPLITS):
        m = tl.maximum(m, tl.load(part_m + (sp * H + h) * M + rows, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for sp in range(SPLITS):
        base = (sp * H + h) * M
        w = tl.exp2(tl.load(part_m + base + rows, mask=row_ok, other=float("-inf")) - m_safe)
        l += w * tl.load(part_l + base + rows, mask=row_ok, other=0.0)
        acc += w[:, None] * tl.load(part_o + (base + rows)[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    o = acc * tl.load(v_scale + h) / tl.where(l == 0.0, 1.0, l)[:, None]
    _store_out(out + rows[:, None] * s_om + h * s_oh + d[None, :], o, row_ok[:, None], OUT_FP8, EXACT)


class FP8Attention:
    """Launcher with its split buffers allocated once (static shapes, CUDA-graph safe)."""

    permutes_v_slots = False  # Vᵀ's slots in their own order

    @staticmethod
    def arrange_v(vt8: torch.Tensor) -> torch.Tensor:
        """Vᵀ (H, D, S) in slot order as this kernel reads it: as it is."""
        return vt8

    def __init__(self, n_heads: int, n_queries: int, n_slots: int, head_dim: int, device: torch.device,
                 block_m: int = 64, block_n: int = 128, splits: int = 1, num_warps: int = 4, num_stages: int = 3,
                 pv_fp8: bool = True, warp_specialize: bool = False, exp2: str = "mufu", lazy_rescale: bool = False,
                 tma: bool = False):
        if exp2 not in EXP2_UNITS:
            raise ValueError(f"exp2 must be one of {', '.join(EXP2_UNITS)}, got {exp2!r}")
        for name, value in (("block_m", block_m), ("block_n", block_n), ("splits", splits), ("num_warps", num_warps),
                            ("num_stages", num_stages)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        self.H, self.M, self.S, self.D = n_heads, n_queries, n_slots, head_dim
        self.exp2, self.lazy_rescale = exp2, lazy_rescale
        self.block_m, self.block_n, self.splits = block_m, block_n, splits
        self.num_warps, self.num_stages, self.pv_fp8 = num_warps, num_stages, pv_fp8
        self.warp_specialize = warp_specialize and not interpreting()
        self.blocks_per_split = triton.cdiv(triton.cdiv(n_slots, splits), block_n)
        self.even_n = splits * self.blocks_per_split * block_n == n_slots
        if tma and not self.even_n:
            raise ValueError(f"tma needs the slots ({n_slots}) to be a whole number of splits x block_n ({splits} x {block_n})")
        self.tma = tma
        self._tma_descriptors: dict[tuple[int, int], tuple] = {}  # per (k, vt) buffer pair: one per cache layer
        shape = (max(splits, 1), n_heads, n_queries)
        self.part_o = torch.empty(*shape, head_dim, device=device, dtype=torch.float32) if splits > 1 else None
        self.part_m = torch.empty(shape, device=device, dtype=torch.float32) if splits > 1 else None
        self.part_l = torch.empty(shape, device=device, dtype=torch.float32) if splits > 1 else None

    def __call__(self, q8: torch.Tensor, k8: torch.Tensor, vt8: torch.Tensor, valid: torch.Tensor,
                 qk_scale: torch.Tensor, v_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """q8 (H, M, D), k8 (H, S, D), vt8 (H, D, S) e4m3 -> out (M, H*D) bf16 or e4m3.

        qk_scale (H,) = q_scale * k_scale * log2(e) / sqrt(D); v_scale (H,): V's scales, divided by the
        output's scale when `out` is e4m3 (`out_scale`).
        """
        H, M, D = q8.shape
        out_fp8 = check_out(out, M, H * D)
        grid = (triton.cdiv(M, self.block_m), H, self.splits)
        dummy = out
        k_desc, vt_desc = self._descriptors(k8, vt8) if self.tma else (k8, vt8)
        _attn_kernel[grid](
            q8, k8, vt8, valid, qk_scale, v_scale, k_desc, vt_desc, out, out.stride(0), D,
            self.part_o if self.splits > 1 else dummy, self.part_m if self.splits > 1 else dummy,
            self.part_l if self.splits > 1 else dummy,
            H, M, self.S, self.blocks_per_split,
            D=D, BLOCK_M=self.block_m, BLOCK_N=self.block_n, SPLITS=self.splits, EXACT=interpreting(),
            PV_FP8=self.pv_fp8, WARP_SPECIALIZE=self.warp_specialize, EXP2_UNIT=self.exp2,
            LAZY_RESCALE=self.lazy_rescale, EVEN_N=self.even_n, TMA=self.tma, OUT_FP8=out_fp8,
            num_warps=self.num_warps, num_stages=self.num_stages, **FP_FUSION,
        )
        if self.splits > 1:
            _merge_kernel[(triton.cdiv(M, 64), H)](
                self.part_o, self.part_m, self.part_l, v_scale, out, out.stride(0), D, H, M,
                D=D, BLOCK_M=64, SPLITS=self.splits, OUT_FP8=out_fp8, EXACT=interpreting(), num_warps=4, **FP_FUSION,
            )
        return out

    def mark_live_tiles(self, valid: torch.Tensor) -> None:
        """Nothing to record: this kernel reads the validity bytes of every tile."""

    def _descriptors(self, k8: torch.Tensor, vt8: torch.Tensor) -> tuple:
        """TMA descriptors of k as (H*S, D) and vt as (H*D, S), made once per buffer pair."""
        key = (k8.data_ptr(), vt8.data_ptr())
        if key not in self._tma_descriptors:
            from triton.tools.tensor_descriptor import TensorDescriptor

            H, S, D = self.H, self.S, self.D
            self._tma_descriptors[key] = (TensorDescriptor.from_tensor(k8.view(H * S, D), [self.block_n, D]),
                                          TensorDescriptor.from_tensor(vt8.view(H * D, S), [D, self.block_n]))
        return self._tma_descriptors[key]


def check_out(out: torch.Tensor, rows: int, cols: int) -> bool:
    """Whether the attention's output `out` is e4m3 (else bf16); a clear error for anything else."""
    if out.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or out.shape != (rows, cols) or out.stride(1) != 1:
        raise ValueError(f"out must be bf16 or float8_e4m3fn ({rows}, {cols}) with contiguous rows, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    return out.dtype == torch.float8_e4m3fn


def out_scale(v_scale: torch.Tensor, n_slots: int) -> torch.Tensor:
    """(..., H) V's per-head scales -> (...) one scale for an e4m3 attention output that never saturates.

    Each output row of a head is a convex combination of that head's V rows, |v| <= 448 * v_scale, but
    its weights are P rounded to e4m3 over a sum of unrounded P: at most 2^-4 above each normal value,
    2^-10 above each subnormal one, against a sum of at least 2^8 (the row's largest P). So |o| stays
    within 448 * (1 + 2^-4 + n_slots * 2^-18) * v_scale. One scale for all heads keeps the
    out-projection's activations row-scaled as its FP8 GEMM takes them (the same scale on every row)."""
    return v_scale.amax(-1) * (1.0 + 2.0**-4 + n_slots * 2.0**-18)


def qk_scale(q_scale: torch.Tensor, k_scale: torch.Tensor, head_dim: int) -> torch.Tensor:
    return (q_scale * k_scale * (LOG2E / math.sqrt(head_dim))).float()


def attention_reference(q8: torch.Tensor, k8: torch.Tensor, vt8: torch.Tensor, valid: torch.Tensor,
                        q_scale: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """The same function in plain PyTorch: dequantise, masked softmax attention, (M, H*D) float32."""
    q = q8.float() * q_scale.view(-1, 1, 1)
    k = k8.float() * k_scale.view(-1, 1, 1)
    v = vt8.float().transpose(1, 2) * v_scale.view(-1, 1, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=valid.bool().view(1, 1, 1, -1))[0]
    return o.transpose(0, 1).flatten(1)
