"""FP8 attention over the ring cache, warp-specialised for Hopper (Gluon).

The function of fp8_attention.py (q (H, M, D), K (H, S, D), V stored transposed (H, D, S), all e4m3
with one scale per head, a validity byte per slot; output (M, H*D) bf16), scheduled by hand the way
FlashAttention-3 schedules it, which Triton's own pipeliner does not. V's slots come in the order the
P·V product reads them straight from the softmax's registers (`pv_slot_order`, written so by the cache;
in their own order with `renamed_p=False`, which shuffles P instead).

- one producer warp streams K and Vᵀ tiles through the copy engine (TMA) into a ring of shared-memory
  stages, each guarded by a ready and an empty barrier, so loads never wait behind arithmetic;
- the consumer warpgroup issues q·kᵀ of block i+1 and P·V of block i together and waits for q·kᵀ only.
  The source waits for P·V after the softmax of block i+1, but ptxas moves that wait to the softmax's
  start, so in the compiled kernel P·V overlaps the q·kᵀ wait, not the softmax;
- two programs share an SM (registers capped with `maxnreg`), so one's softmax covers the other's
  products; or, with block_m 128, one program runs two consumer warpgroups in partitions of their
  own that share every K/V tile (half the tile traffic, more registers each), optionally issuing their
  products alternately (`pingpong`, FlashAttention-3's schedule).

Both products run in FP8 with probabilities scaled by 256 before rounding, as in fp8_attention.py. As there,
`exp2` puts the softmax's 2^x on the special-function unit ("mufu"), on the FMA and integer units ("fma",
fp8_attention.py's polynomial) or half on each ("mixed"); it stays on the special-function unit by default
(docs/kernels.md). Two options take the softmax's elementwise work off the other units:

- `row_sum="tensor"`: the rows' sums of P come from the tensor cores, a P·1 product (8 columns of ones) issued
  beside P·V, fresh each block and added in FP32, in place of 64 adds a thread and block; the sum is then of the
  e4m3 P that P·V reads.
- `exp2="e4m3_bits"` (with it): 2^x is written straight into e4m3's bits, log-linearly (`e4m3_log_linear`), by
  one FMA a probability, then per pair one conversion to f16x2 that rounds both codes and one f16x2 max that clamps
  them, and per 4 one byte permute that makes a register of P·V's operand: no special-function instruction and no
  conversion to e4m3 remain. It picks a code next to the nearest one where the rounding is close, so it adds some
  error against P nearest 2^x; with 128-row tiles it is what the ring serves (`SERVED_OPTIONS`), its change to the
  served clips within the rerun band (docs/quality.md).

`tma_out`: each consumer warpgroup writes its output tile to shared memory, and one TMA store sends it out in whole
lines (rows past M clipped by the copy engine), in place of each thread storing its fragments of a row (16 bytes of
bf16, 8 of e4m3, per row and store instruction): the same values bit for bit. Served, at up to 32 KiB more shared
memory a program with 128-row tiles, which hold one program an SM either way (at 64 rows it would cost the second).

Hopper only: there is no CPU interpreter for Gluon; tests compile it for sm_90a on any machine and
hold it to `attention_reference` (fp8_attention.py's PyTorch reference) on a GPU. Choices and what was tried:
docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from engine.kernels.fp8_attention import EXP2_UNITS, _exp2_fma, check_out
from engine.kernels.launch import FP_FUSION, WS_HEAD_DIMS

WS_EXP2_UNITS = EXP2_UNITS + ("e4m3_bits",)

# The TMA load's name: async_copy_global_to_shared up to Triton 3.6, async_load from 3.9 (the old name then raises)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# A barrier of the partition's threads: thread_barrier up to Triton 3.6, barrier from 3.9
_thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _producer(q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
              q_row, k_row, v_row, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem)
    for i in range(n_blocks):
        stage = i % STAGES
        phase = (i // STAGES) & 1
        # A fresh barrier counts as having completed the phase before 0: the first pass does not wait.
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        _tma_load(k_desc, [k_row + i * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), vt_desc.block_type.nbytes)
        _tma_load(vt_desc, [v_row, i * BLOCK_N], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _max(a, b):  # reduction operators of our own: gl.max and gl.sum turn into interpreter
    return gl.maximum(a, b)  # functions under TRITON_INTERPRET=1, which Gluon cannot compile


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _halve_top(x):
    """(M, W) -> (M, W/2): the max of columns c and c + W/2, which one thread holds (the top column bit is
    a register bit of the wgmma accumulator's layout while W > 4)."""
    M: gl.constexpr = x.shape[0]
    W: gl.constexpr = x.shape[1]
    a, b = gl.split(gl.permute(gl.reshape(x, [M, 2, W // 2]), [0, 2, 1]))
    return gl.maximum(a, b)


@gluon.jit
def _row_max(s, rows: gl.constexpr):
    """Row maxima of a score tile as a tree over each thread's columns, then across the row's 4 lanes. A plain
    reduction chains the thread's 32 columns of a row one after another (31 dependent FMNMX, and the second
    row's after the first's); the tree's depth is 5 and its operations independent. Exact either way."""
    M: gl.constexpr = s.shape[0]
    N: gl.constexpr = s.shape[1]
    a, b = gl.split(gl.reshape(s, [M, N // 2, 2]))  # column bit 0: the pair a thread holds side by side
    x = gl.maximum(a, b)
    if N // 2 > 32:
        x = _halve_top(x)
    if N // 2 > 16:
        x = _halve_top(x)
    if N // 2 > 8:
        x = _halve_top(x)
    if N // 2 > 4:
        x = _halve_top(x)
    return gl.convert_layout(gl.reduce(x, 1, _max), rows, assert_trivial=True)


# fp8_attention.py's 2^x on the FMA and integer units, the same body built as Gluon
_exp2_poly = gluon.jit(_exp2_fma.fn)


@gluon.constexpr_function
def _row_quads(block_n):
    """The layout of a consumer warpgroup's (64, block_n) score tile (wgmma's accumulator, 4 warps) with each thread's
    registers reordered so that every 4 consecutive ones hold one row's columns c, c+1, c+8, c+9."""
    cols = [[0, 1 << k] for k in range(4, block_n.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 8], [8, 0], *cols], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, block_n])


@gluon.jit
def _softmax_block(s, valid, all_live, tile, S, scale, m_i, l_i, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                   TREE_MAX: gl.constexpr, EXP2_UNIT: gl.constexpr, ROW_SUM_TC: gl.constexpr):
    """Online softmax of score block `tile`, in log2 units, against (max - 8). Tiles known to be fully
    live skip the per-slot mask (the validity bytes cost as much as the exponentials)."""
    if all_live == 0:
        cols = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        live = gl.load(valid + cols, mask=cols < S, other=0) != 0  # empty ring slots, padding, tiles past S
        s = gl.where(live[None, :], s, float("-inf"))
    if TREE_MAX:
        m_new = gl.maximum(m_i, _row_max(s, gl.SliceLayout(1, s_layout)) * scale)
    else:  # the plain reduction
        m_new = gl.maximum(m_i, gl.reduce(s, 1, _max) * scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no live slot yet
    alpha = gl.exp2(m_i - m_safe)
    if EXP2_UNIT == "e4m3_bits":
        # 2^x written straight as e4m3's bits, log-linearly: code 8x + 56 is the exponent (bias 7) and three mantissa
        # bits of 2^floor(x) * (1 + frac(x)); rounded after taking 0.35 off, it lands within 7.5% of 2^x where the code
        # is normal, x >= -6 (e4m3's nearest value: 5.9%); below, 2^x <= 2^-6 of P's largest 256. One FMA makes
        # 1536 + code; converting a pair to f16x2 rounds both to whole numbers (f16's step is 1 in [1024, 2048)), so
        # each half's low byte is its code; one f16x2 max clamps both at 1536, code 0 (x below about -7, and masked
        # slots' -inf); the top needs none, as x <= 8 gives code <= 120. No special-function instruction runs, and
        # `_p_operand` packs a register of P·V's operand from two pairs by one byte permute.
        # Each thread's elements regrouped (a register renaming: no data moves) so that every 4 in a row are one row's
        # columns c, c+1, c+8 and c+9: after the renaming in `_p_operand`, the 4 bytes of one register of P·V's A operand.
        rows4: gl.constexpr = _row_quads(s.shape[1])
        s4 = gl.convert_layout(s, rows4, assert_trivial=True)
        b = gl.convert_layout(1536.0 + 120.0 - 0.35 - 8.0 * m_safe, gl.SliceLayout(1, rows4), assert_trivial=True)
        p = gl.inline_asm_elementwise(  # the pair's f16x2 in its first element; its second is left unset, never read
            """{
            .reg .f32 y<2>;
            .reg .b32 h<2>;
            fma.rn.f32 y0, $2, $4, $6;
            fma.rn.f32 y1, $3, $5, $7;
            cvt.rn.f16x2.f32 h0, y1, y0;
            mov.b32 h1, 0x66006600;
            max.f16x2 $0, h0, h1;
            }""", "=r,=r,f,f,f,f,f,f",
            [s4, gl.full_like(s4, 8.0) * scale, b[:, None]], dtype=gl.int32, is_pure=True, pack=2)
    else:
        x = s * scale - (m_safe - 8.0)[:, None]  # 2^x <= 256: inside e4m3's 448
        if EXP2_UNIT == "fma":
            p = _exp2_poly(x)
        elif EXP2_UNIT == "mixed":  # the column pairs a thread holds side by side: one on each unit
            M: gl.constexpr = x.shape[0]
            x_mufu, x_fma = gl.split(gl.reshape(x, [M, BLOCK_N // 2, 2]))
            p = gl.convert_layout(gl.reshape(gl.join(gl.exp2(x_mufu), _exp2_poly(x_fma)), [M, BLOCK_N]), s_layout,
                                  assert_trivial=True)
        else:
            p = gl.exp2(x)
    if not ROW_SUM_TC:
        l_i = l_i * alpha + gl.reduce(p, 1, _add)
    return p, m_new, l_i, alpha


@gluon.jit
def _p_operand(p, p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, RENAMED_P: gl.constexpr):
    """P (BLOCK_M, BLOCK_N) fp32 (or e4m3 codes already) in the q·kᵀ accumulator's registers -> the P·V product's e4m3 A operand, with
    no data moved. In each group of 32 columns a thread of the accumulator holds the columns whose bits
    (c4 c3 c2 c1 c0) come from (register register lane lane register); an 8-bit A operand wants (register lane
    lane register register). The columns are renamed by that bit permutation (reshape, permute: registers
    only); V's slots are stored in the same order (`pv_slot_order`), so the product is unchanged. Converting
    the layout instead (RENAMED_P False: V's slots in their own order) shuffles P between threads at every
    block (`lab.bench attention` times both)."""
    if p.dtype == gl.int32:  # e4m3 codes in f16x2 pairs (`_row_quads` layout): one row's 4 codes a register, one byte move
        p = gl.inline_asm_elementwise("prmt.b32 $0, $1, $3, 0x6420;", "=r,r,r,r,r", [p], dtype=gl.int8, is_pure=True,
                                      pack=4).to(gl.float8e4nv, bitcast=True)
    if not RENAMED_P:
        return gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    p8 = gl.reshape(p.to(gl.float8e4nv), [BLOCK_M, BLOCK_N // 32, 2, 2, 2, 2, 2])  # (row, group, c4, c3, c2, c1, c0)
    p8 = gl.reshape(gl.permute(p8, [0, 1, 2, 4, 5, 3, 6]), [BLOCK_M, BLOCK_N])  # column c4 c2 c1 c3 c0
    return gl.convert_layout(p8, p_layout, assert_trivial=True)


@gluon.jit
def _row_sums(p8, ones_smem, l_layout: gl.constexpr):
    """Issue P·1 (asynchronously, from a zero accumulator): each row's sum of the e4m3 P in all 8 columns."""
    M: gl.constexpr = p8.shape[0]
    p8_l = gl.convert_layout(p8, gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4), assert_trivial=True)
    return warpgroup_mma(p8_l, ones_smem.permute((1, 0)), gl.zeros([M, 8], gl.float32, l_layout), use_acc=False,
                         is_async=True)


def e4m3_log_linear(x: torch.Tensor) -> torch.Tensor:
    """What `exp2="e4m3_bits"` writes for 2^x (x <= 8, where the code is at most 120), in PyTorch: the e4m3 code
    round(8x + 56 - 0.35), clamped at 0."""
    code = torch.clamp(torch.round(8 * x.float() + 56 - 0.35), min=0).to(torch.uint8)
    return code.view(torch.float8_e4m3fn).float()


def pv_slot_order(n_slots: int, device=None) -> torch.Tensor:
    """(n_slots,) the slot whose V this kernel reads at each position of Vᵀ's slot axis: `_p_operand`'s
    renaming within every group of 32 slots. Bit 4 stays, so each group of 16 maps onto itself and any
    multiple of 16 slots is closed under it."""
    if n_slots % 16:
        raise ValueError(f"the slots ({n_slots}) must be a multiple of 16")
    in_group = torch.arange(32).view(2, 2, 2, 2, 2).permute(0, 2, 3, 1, 4).reshape(32)  # (c4 c2 c1 c3 c0) -> c
    order = (torch.arange(0, n_slots + 16, 32).view(-1, 1) + in_group).view(-1)
    return order[order < n_slots].to(device)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, ones_smem, q_bar, k_ready, k_empty, v_ready, v_empty, my_turn, their_turn, valid,
              tile_live, qk_scale, v_scale, out, s_om, out_desc, o_smem, h, off_m, M, S, n_blocks, D: gl.constexpr,
              BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, RENAMED_P: gl.constexpr, PINGPONG: gl.constexpr,
              FIRST: gl.constexpr, OUT_FP8: gl.constexpr, TMA_OUT: gl.constexpr, TREE_MAX: gl.constexpr, EXP2_UNIT: gl.constexpr,
              ROW_SUM_TC: gl.constexpr, num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    scale = gl.load(qk_scale + h)  # q_scale * k_scale / sqrt(D) * log2(e)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    if ROW_SUM_TC:  # the rows' sums of P come from the tensor cores, as P·1 beside P·V (1 in each of 8 columns)
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, 8, 32])
        # Each block's sums come fresh and are added here, in FP32: the tensor cores' FP8 accumulation keeps only
        # about 14 bits, which a sum that only grows would lose small terms to.
        l_run = gl.zeros([BLOCK_M, 8], gl.float32, l_layout)
        ones_layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_N // 32], [2, 16], [num_warps, 1], [1, 0])
        ones_smem.store(gl.full([8, BLOCK_N], 0x38, gl.int8, ones_layout).to(gl.float8e4nv, bitcast=True))  # 1.0
        fence_async_shared()
        _thread_barrier()  # every warp's part of the ones written before any warp's product reads the tile

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax_block(s, valid, gl.load(tile_live), 0, S, scale, m_i, l_i, BLOCK_N, s_layout, TREE_MAX, EXP2_UNIT, ROW_SUM_TC)
    for i in range(n_blocks - 1):
        cur = i % STAGES
        nxt = (i + 1) % STAGES
        live_next = gl.load(tile_live + i + 1)  # issued early: its latency hides behind the products
        mbarrier.wait(k_ready.index(nxt), ((i + 1) // STAGES) & 1)
        if PINGPONG:  # the two consumers take turns to issue their products: one's softmax runs under the other's
            p8 = _p_operand(p, p_layout, BLOCK_M, BLOCK_N, RENAMED_P)
            mbarrier.wait(v_ready.index(cur), (i // STAGES) & 1)
            mbarrier.wait(my_turn, (i + FIRST) & 1)  # the first consumer's first turn passes at once (fresh barrier)
            s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p8, v_smem.index(cur).permute((1, 0)), acc, is_async=True)
            mbarrier.arrive(their_turn, count=1)
        else:
            s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            p8 = _p_operand(p, p_layout, BLOCK_M, BLOCK_N, RENAMED_P)
            mbarrier.wait(v_ready.index(cur), (i // STAGES) & 1)
            o_tok = warpgroup_mma(p8, v_smem.index(cur).permute((1, 0)), acc, is_async=True)
        if ROW_SUM_TC:
            l_tok = _row_sums(p8, ones_smem, l_layout)
            s = warpgroup_mma_wait(2, deps=[s_tok])
        else:
            s = warpgroup_mma_wait(1, deps=[s_tok])  # q·kᵀ done; ptxas waits for P·V at the softmax's start
        mbarrier.arrive(k_empty.index(nxt), count=1)
        p, m_i, l_i, alpha = _softmax_block(s, valid, live_next, i + 1, S, scale, m_i, l_i, BLOCK_N, s_layout, TREE_MAX, EXP2_UNIT, ROW_SUM_TC)
        if ROW_SUM_TC:
            acc, l_blk = warpgroup_mma_wait(0, deps=[o_tok, l_tok])
            l_run = (l_run + l_blk) * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
        else:
            acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(v_empty.index(cur), count=1)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    last = (n_blocks - 1) % STAGES
    p8 = _p_operand(p, p_layout, BLOCK_M, BLOCK_N, RENAMED_P)
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p8, v_smem.index(last).permute((1, 0)), acc, is_async=True)
    if ROW_SUM_TC:
        l_tok = _row_sums(p8, ones_smem, l_layout)
        acc, l_blk = warpgroup_mma_wait(0, deps=[o_tok, l_tok])
        # the 8 columns hold the same sums; a reduction gives each row's one value in the row layout
        l_i = gl.convert_layout(gl.reduce(l_run + l_blk, 1, _max), gl.SliceLayout(1, s_layout))
    else:
        acc = warpgroup_mma_wait(0, deps=[o_tok])

    l_o = gl.convert_layout(l_i, o_rows)
    o = acc * (gl.load(v_scale + h) / gl.where(l_o == 0.0, 1.0, l_o))[:, None]
    if OUT_FP8:  # the scale of `out_scale` keeps |o| <= 448: the clamp only keeps the cast saturating
        o_out = gl.minimum(gl.maximum(o, -448.0), 448.0).to(gl.float8e4nv)
    else:
        o_out = o.to(gl.bfloat16)
    if TMA_OUT:  # staged in shared memory, written by the copy engine in whole lines; rows past M are clipped by it
        o_smem.store(o_out)
        fence_async_shared()
        _thread_barrier()  # every thread's part in shared memory before the copy reads it
        _tma_store(out_desc, [off_m, h * D], o_smem)
        tma.store_wait(0)
    else:
        rows = off_m + gl.arange(0, BLOCK_M, layout=o_rows)
        d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        gl.store(out + rows[:, None] * s_om + h * D + d[None, :], o_out, mask=(rows < M)[:, None])


@gluon.jit
def _per_consumer(buf, rows: gl.constexpr, CONSUMERS: gl.constexpr):
    """The first and the last consumer warpgroup's `rows` rows of a shared buffer of CONSUMERS * rows rows."""
    return buf.slice(0, rows), buf.slice(rows * (CONSUMERS - 1), rows)


@gluon.jit
def _attn_ws_kernel(q_desc, k_desc, vt_desc, valid, tile_live, qk_scale, v_scale, out, s_om, out_desc, M, S,
                    D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, RENAMED_P: gl.constexpr, PINGPONG: gl.constexpr, OUT_FP8: gl.constexpr,
                    TMA_OUT: gl.constexpr, TREE_MAX: gl.constexpr, EXP2_UNIT: gl.constexpr, ROW_SUM_TC: gl.constexpr, num_warps: gl.constexpr):
    pid_m, h = gl.program_id(0), gl.program_id(1)
    off_m = pid_m * BLOCK_M
    n_blocks = (S + BLOCK_N - 1) // BLOCK_N
    CONSUMERS: gl.constexpr = BLOCK_M // 64  # warpgroups of 64 query rows each, sharing every K/V tile
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BLOCK_N], vt_desc.layout)
    if ROW_SUM_TC:  # 8 columns of ones, K-major like Vᵀ's tiles (one per consumer warpgroup: each writes its own)
        ones_a, ones_b = _per_consumer(gl.allocate_shared_memory(
            gl.float8e4nv, [CONSUMERS * 8, BLOCK_N], gl.NVMMASharedLayout.get_default_for([8, BLOCK_N], gl.float8e4nv)), 8, CONSUMERS)
    else:  # never read
        ones_a, ones_b = q_smem, q_smem
    if TMA_OUT:  # each consumer warpgroup's output tile on its way to global memory
        o_a, o_b = _per_consumer(gl.allocate_shared_memory(out_desc.dtype, [CONSUMERS * 64, D], out_desc.layout), 64, CONSUMERS)
    else:  # never written
        o_a, o_b = q_smem, q_smem
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    if PINGPONG:  # whose turn it is to issue products: the first consumer's, then the second's
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turns.index(0), count=1)
        mbarrier.init(turns.index(1), count=1)
        turn_a, turn_b = turns.index(0), turns.index(1)
    else:  # never waited on
        turn_a, turn_b = q_bar, q_bar
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # a stage is free once every consumer is done with it
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    # q as (H*M, D): a tile past this head's M rows reads the next head's (never stored) or zeros (TMA
    # fills past the end); K as (H*S, D) likewise, the slots past S masked; Vᵀ as (H*D, S).
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, ones_a, q_bar, k_ready, k_empty, v_ready, v_empty, turn_a, turn_b, valid,
                         tile_live, qk_scale, v_scale, out, s_om, out_desc, o_a, h, off_m, M, S, n_blocks, D, 64, BLOCK_N,
                         STAGES, RENAMED_P, False, 1, OUT_FP8, TMA_OUT, TREE_MAX, EXP2_UNIT, ROW_SUM_TC, num_warps)),
            (_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                         h * M + off_m, h * S, h * D, n_blocks, BLOCK_N, STAGES)),
        ], [1], [24])
    else:  # two consumer warpgroups in their own partitions: each issues its products and softmax on its own schedule
        gl.warp_specialize([
            (_consumer, (q_smem.slice(0, 64), k_smem, v_smem, ones_a, q_bar, k_ready, k_empty, v_ready, v_empty, turn_a,
                         turn_b, valid, tile_live, qk_scale, v_scale, out, s_om, out_desc, o_a, h, off_m, M, S, n_blocks,
                         D, 64, BLOCK_N, STAGES, RENAMED_P, PINGPONG, 1, OUT_FP8, TMA_OUT, TREE_MAX, EXP2_UNIT, ROW_SUM_TC, num_warps)),
            (_consumer, (q_smem.slice(64, 64), k_smem, v_smem, ones_b, q_bar, k_ready, k_empty, v_ready, v_empty, turn_b,
                         turn_a, valid, tile_live, qk_scale, v_scale, out, s_om, out_desc, o_b, h, off_m + 64, M, S,
                         n_blocks, D, 64, BLOCK_N, STAGES, RENAMED_P, PINGPONG, 0, OUT_FP8, TMA_OUT, TREE_MAX, EXP2_UNIT, ROW_SUM_TC, 4)),
            (_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                         h * M + off_m, h * S, h * D, n_blocks, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])


# What the ring cache serves when no options are given: P as log-linear e4m3 codes with row sums on the tensor
# cores, two consumer warpgroups per program, the output through shared memory by TMA. Judged against the plain path
# by the rerun-variance method (docs/quality.md; the TMA store changes no value); why these: docs/kernels.md.
SERVED_OPTIONS = dict(block_m=128, block_n=128, stages=2, row_sum="tensor", exp2="e4m3_bits", tma_out=True)
# The options before it: P as the e4m3 value nearest 2^x (the special-function unit's), row sums in FP32.
NEAREST_P_OPTIONS = dict(block_m=64, block_n=128, stages=3, row_sum="fma", exp2="mufu")


def descriptor_layouts(block_m: int, block_n: int, head_dim: int) -> tuple:
    """Shared-memory layouts of the q, K and Vᵀ tiles (128-byte swizzle where the rows allow)."""
    fp8 = gl.float8e4nv
    return (gl.NVMMASharedLayout.get_default_for([block_m, head_dim], fp8),
            gl.NVMMASharedLayout.get_default_for([block_n, head_dim], fp8),
            gl.NVMMASharedLayout.get_default_for([head_dim, block_n], fp8))


class WarpSpecializedFP8Attention:
    """Launcher, called like FP8Attention but with Vᵀ's slots in `pv_slot_order` (`permutes_v_slots`: the
    ring cache stores them so; with `renamed_p` False in their own order, P then shuffled between threads
    into the P·V operand's layout at every block). block_m 64 runs one consumer warpgroup per program,
    two programs per SM (maxnreg 128); block_m 128 runs two consumer warpgroups in partitions of their
    own, sharing each K/V tile (half the tile traffic), one program per SM with more registers each.
    `row_sum` ("fma" or "tensor") and `exp2` (also "e4m3_bits", which takes row_sum "tensor"): the module's docstring."""

    def arrange_v(self, vt8: torch.Tensor) -> torch.Tensor:
        """Vᵀ (H, D, S) in slot order -> the order this kernel reads (a copy; the cache writes it so directly)."""
        return vt8[..., pv_slot_order(vt8.shape[-1], vt8.device)].contiguous() if self.permutes_v_slots else vt8

    def __init__(self, n_heads: int, n_queries: int, n_slots: int, head_dim: int, device=None,
                 block_m: int = 64, block_n: int = 128, stages: int = 3, maxnreg: int | None = None,
                 pingpong: bool = False, renamed_p: bool = True, tree_max: bool = True, exp2: str = "mufu",
                 row_sum: str = "fma", tma_out: bool = False):
        if exp2 not in WS_EXP2_UNITS:
            raise ValueError(f"exp2 must be one of {', '.join(WS_EXP2_UNITS)}, got {exp2!r}")
        if row_sum not in ("fma", "tensor"):
            raise ValueError(f"row_sum must be fma or tensor, got {row_sum!r}")
        if exp2 == "e4m3_bits" and row_sum != "tensor":
            raise ValueError("exp2='e4m3_bits' needs row_sum='tensor' (P exists only as e4m3 codes: there is no FP32 P to sum)")
        if head_dim not in WS_HEAD_DIMS:  # the P·V product's N; TMA rows of at least 32 bytes
            raise ValueError(f"head_dim must be one of {WS_HEAD_DIMS} for the warp-specialised kernel, got {head_dim}")
        if block_m not in (64, 128):
            raise ValueError(f"block_m must be 64 or 128 (one or two consumer warpgroups), got {block_m}")
        if block_n not in (32, 64, 128):  # TMA tiles are powers of two; 256 leaves too few registers
            raise ValueError(f"block_n must be 32, 64 or 128, got {block_n}")
        if stages < 2:
            raise ValueError(f"stages must be >= 2 (loads run ahead of the products), got {stages}")
        if n_slots % 16:
            raise ValueError(f"the slots ({n_slots}) must be a multiple of 16 (TMA rows of 16 bytes)")
        self.H, self.M, self.S, self.D = n_heads, n_queries, n_slots, head_dim
        if pingpong and block_m != 128:
            raise ValueError("pingpong takes two consumer warpgroups: block_m 128")
        if pingpong and row_sum == "tensor":  # P·1 would be issued after the turn passes to the other warpgroup
            raise ValueError("pingpong with row_sum='tensor' is not built: its P·1 product would fall outside the turns")
        self.block_m, self.block_n, self.stages = block_m, block_n, stages
        self.pingpong = pingpong  # the two consumers issue their products alternately (FlashAttention-3's ping-pong)
        self.permutes_v_slots = renamed_p
        self.tree_max = tree_max  # row maxima as a tree (`_row_max`); False: the plain reduction
        self.exp2 = exp2  # where the softmax's 2^x runs, as in fp8_attention.py
        self.row_sum = row_sum  # the rows' sums of P: on the FMA units, or as P·1 on the tensor cores
        self.tma_out = tma_out  # the output through shared memory and the copy engine instead of stored from registers
        self.num_warps = 4  # the default partition: one consumer warpgroup
        # block_m 128 launches 12 warps (partitions come in warpgroups): 168 registers each fill the register
        # file; then the producer's warpgroup gives its registers to the consumer warpgroup in a partition of its own.
        self.maxnreg = maxnreg if maxnreg is not None else (128 if block_m == 64 else 168)
        self.consumer_regs = 232 if block_m == 128 else 0
        self._descriptors: dict[tuple[int, int, int], tuple] = {}
        # Per K/V tile, 1 where every slot is known live: set by mark_live_tiles, 0 (masked, always
        # correct) until then. Slots only ever turn live, so a mark made before writes stays true.
        self.tile_live = torch.zeros(triton.cdiv(n_slots, block_n), dtype=torch.int8, device=device)

    def mark_live_tiles(self, valid: torch.Tensor) -> None:
        """Record which tiles of `valid` (S,) are fully live; once a step, outside any CUDA graph."""
        full = self.S // self.block_n  # a partial last tile stays masked
        self.tile_live[:full].copy_((valid[: full * self.block_n].view(full, self.block_n) != 0).all(1))

    def __call__(self, q8, k8, vt8, valid, qk_scale, v_scale, out):
        """q8 (H, M, D), k8 (H, S, D), vt8 (H, D, S) e4m3 -> out (M, H*D) bf16 or e4m3; scales as FP8Attention.
        vt8[:, :, j] holds the V of slot pv_slot_order(S)[j] (of slot j with renamed_p False: see arrange_v)."""
        H, M, D = q8.shape
        out_fp8 = check_out(out, M, H * D)
        q_desc, k_desc, vt_desc = self.descriptors(q8, k8, vt8)
        out_desc = self.out_descriptor(out) if self.tma_out else q_desc  # (never read without tma_out)
        _attn_ws_kernel[(triton.cdiv(M, self.block_m), H)](
            q_desc, k_desc, vt_desc, valid, self.tile_live, qk_scale, v_scale, out, out.stride(0), out_desc, M, self.S,
            D=D, BLOCK_M=self.block_m, BLOCK_N=self.block_n, STAGES=self.stages, CONSUMER_REGS=self.consumer_regs,
            RENAMED_P=self.permutes_v_slots, PINGPONG=self.pingpong, OUT_FP8=out_fp8, TMA_OUT=self.tma_out,
            TREE_MAX=self.tree_max, EXP2_UNIT=self.exp2,
            ROW_SUM_TC=self.row_sum == "tensor", num_warps=self.num_warps, maxnreg=self.maxnreg, **FP_FUSION)
        return out

    def descriptors(self, q8, k8, vt8) -> tuple:
        """TMA descriptors of q as (H*M, D), K as (H*S, D) and Vᵀ as (H*D, S), made once per buffer triple."""
        key = (q8.data_ptr(), k8.data_ptr(), vt8.data_ptr())
        if key not in self._descriptors:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

            H, M, S, D = self.H, self.M, self.S, self.D
            q_l, k_l, v_l = descriptor_layouts(self.block_m, self.block_n, D)
            self._descriptors[key] = (TensorDescriptor.from_tensor(q8.view(H * M, D), [self.block_m, D], q_l),
                                      TensorDescriptor.from_tensor(k8.view(H * S, D), [self.block_n, D], k_l),
                                      TensorDescriptor.from_tensor(vt8.view(H * D, S), [D, self.block_n], v_l))
        return self._descriptors[key]

    def out_descriptor(self, out: torch.Tensor):
        """TMA descriptor of the output (M, H*D), one consumer warpgroup's tile (64, D) a copy, made once per buffer."""
        key = (out.data_ptr(), out.dtype, tuple(out.shape), out.stride(0))
        if key not in self._descriptors:  # the key fixes the start and row stride: checked once per buffer
            if out.data_ptr() % 16 or (out.stride(0) * out.element_size()) % 16:  # what a TMA descriptor takes
                raise ValueError(f"tma_out needs the output's start and row stride 16-byte aligned, got address "
                                 f"{out.data_ptr() % 16} past 16 bytes and a row stride of {out.stride(0) * out.element_size()} bytes")
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

            dtype = gl.float8e4nv if out.dtype == torch.float8_e4m3fn else gl.bfloat16
            layout = gl.NVMMASharedLayout.get_default_for([64, self.D], dtype)
            self._descriptors[key] = TensorDescriptor.from_tensor(out, [64, self.D], layout)
        return self._descriptors[key]


def compile_for_hopper(head_dim: int = 128, block_m: int = 64, block_n: int = 128, stages: int = 3,
                       maxnreg: int | None = None, pingpong: bool = False, renamed_p: bool = True, out_fp8: bool = False,
                       tree_max: bool = True, exp2: str = "mufu", row_sum: str = "fma", tma_out: bool = False):
    """Build the kernel for sm_90a on any machine, GPU or not (Triton ships ptxas): the compiled
    kernel, its PTX under `.asm["ptx"]`. The launch signature depends on tile shapes only."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    att = WarpSpecializedFP8Attention(1, block_m, block_n, head_dim, block_m=block_m, block_n=block_n, stages=stages,
                                      maxnreg=maxnreg, pingpong=pingpong, renamed_p=renamed_p, exp2=exp2,
                                      row_sum=row_sum, tma_out=tma_out)
    fp8 = torch.float8_e4m3fn
    descs = att.descriptors(torch.zeros(1, block_m, head_dim, dtype=fp8), torch.zeros(1, block_n, head_dim, dtype=fp8),
                            torch.zeros(1, head_dim, block_n, dtype=fp8))
    out = torch.zeros(block_m, head_dim, dtype=fp8 if out_fp8 else torch.bfloat16)
    out_desc = att.out_descriptor(out) if tma_out else descs[0]
    signature = {"q_desc": mangle_type(descs[0]), "k_desc": mangle_type(descs[1]), "vt_desc": mangle_type(descs[2]),
                 "valid": "*i8", "tile_live": "*i8", "qk_scale": "*fp32", "v_scale": "*fp32", "out": "*fp8e4nv" if out_fp8 else "*bf16", "s_om": "i32",
                 "out_desc": mangle_type(out_desc), "M": "i32",
                 "S": "i32", "D": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr",
                 "CONSUMER_REGS": "constexpr", "RENAMED_P": "constexpr", "PINGPONG": "constexpr", "OUT_FP8": "constexpr",
                 "TMA_OUT": "constexpr",
                 "TREE_MAX": "constexpr", "EXP2_UNIT": "constexpr", "ROW_SUM_TC": "constexpr",
                 "num_warps": "constexpr"}
    constants = {"D": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "STAGES": stages,
                 "CONSUMER_REGS": att.consumer_regs, "RENAMED_P": renamed_p, "PINGPONG": pingpong, "OUT_FP8": out_fp8,
                 "TMA_OUT": tma_out,
                 "TREE_MAX": tree_max, "EXP2_UNIT": exp2, "ROW_SUM_TC": row_sum == "tensor",
                 "num_warps": att.num_warps}
    return triton.compile(GluonASTSource(_attn_ws_kernel, signature, constexprs=constants),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": att.num_warps, "maxnreg": att.maxnreg, **FP_FUSION})


# An sm_90 SM: 64K 32-bit registers, 228 KiB of shared memory (1 KiB of it reserved by the driver per program), 2048 threads
HOPPER_SM = {"registers": 65536, "shared_bytes": 233472, "reserved_shared_bytes": 1024, "threads": 2048}


def programs_per_sm(kernel, sm: dict[str, int] = HOPPER_SM) -> int:
    """How many programs of a compiled kernel (`compile_for_hopper`) one SM holds at once, from what each claims at
    launch: its threads times the registers it is launched with (`.maxnreg`; the warp-specialised partitions
    trade registers among themselves within that), and its shared memory."""
    md = kernel.metadata
    threads = 32 * md.num_warps
    regs = -(-md.maxnreg // 8) * 8  # registers are allotted per thread in steps of 8
    return min(sm["registers"] // (regs * threads), sm["shared_bytes"] // (md.shared + sm["reserved_shared_bytes"]),
               sm["threads"] // threads)
