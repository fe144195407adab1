"""A block's elementwise work fused around its FP8 GEMMs (serving path, inference only).

The plain block (engine/model.py) runs ~35 small kernels per pass; this runs 3 of its
own beside the GEMMs and attention:

    ln_modulate_quant   LayerNorm -> (1 + scale), + shift -> per-token FP8, shared by q/k/v and MLP-in
    swiglu_quant        silu(gate) * up -> per-token FP8 for MLP-out (where MLP-in runs on the Triton
                        GEMM, its epilogue forms silu(gate) * up: FP8Linear.swiglu_quantized)
    gated_sum           gate_attn * a + gate_mlp * m (+ x when there is no all-reduce between)

and where no all-reduce sits between blocks, `gated_sum_ln_quant` makes a block's residual
and the next block's FP8 input in one pass, so the next block skips its `ln_modulate_quant`.

The per-head RMS norms of q, k and v go to the attend with their gains (`head_norm`): the
FP8 ring cache applies them in the kernel that rotates, quantises and stores q, k, v. The block
asks the attend for its output in e4m3 (`fp8_out`): the FP8 ring's attention kernel writes it
so, at a scale that cannot saturate, and the out-projection reads it with no quantisation pass.

Every kernel is held to the plain PyTorch computation in tests/test_kernels.py (on the CPU under
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import fp8
from engine.kernels import FP_FUSION, interpreting, pdl_launch
from engine.kernels.common import to_fp8, wait_for_previous_kernel


@triton.jit
def _ln_mod_quant_row(v, c, ok, row, shift, scale, h8, sh, K, eps, EXACT: tl.constexpr):
    """Row `row` (float32 v over columns c) -> FP8 of modulate(layer_norm(v)) and its scale."""
    mean = tl.sum(v, 0) / K
    diff = tl.where(ok, v - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, 0) / K + eps)
    h = diff * rstd * (1.0 + tl.load(scale + c, mask=ok, other=0.0).to(tl.float32)) + tl.load(shift + c, mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(tl.where(ok, h, 0.0)), 0), 1e-12) / 448.0
    tl.store(h8 + row * K + c, to_fp8(h / s, EXACT), mask=ok)
    tl.store(sh + row, s)


@triton.jit
def _ln_mod_quant_kernel(x, shift, scale, h8, sh, K, eps, BLOCK_K: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_K)
    ok = c < K
    v = tl.load(x + row * K + c, mask=ok, other=0.0).to(tl.float32)
    _ln_mod_quant_row(v, c, ok, row, shift, scale, h8, sh, K, eps, EXACT)


def ln_modulate_quant(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6):
    """x (N, K) -> FP8 of modulate(layer_norm(x)) (N, K) and per-token scales (N, 1)."""
    N, K = x.shape
    h8 = torch.empty(N, K, device=x.device, dtype=fp8.FP8)
    sh = torch.empty(N, 1, device=x.device, dtype=torch.float32)
    pdl, pdl_kw = pdl_launch(x.device)
    _ln_mod_quant_kernel[(N,)](x, shift, scale, h8, sh, K, eps, BLOCK_K=triton.next_power_of_2(K), EXACT=interpreting(),
                               PDL=pdl, num_warps=8 if K >= 4096 else 4, **FP_FUSION, **pdl_kw)
    return h8, sh


@triton.jit
def _swiglu_quant_kernel(gu, m8, sm, K, BLOCK_K: tl.constexpr, EXACT: tl.constexpr, INTERLEAVE: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_K)
    ok = c < K
    if INTERLEAVE:  # gate and up in alternating blocks of INTERLEAVE columns
        g_col = (c // INTERLEAVE) * 2 * INTERLEAVE + c % INTERLEAVE
        u_col = g_col + INTERLEAVE
    else:  # [gate | up]
        g_col = c
        u_col = K + c
    g = tl.load(gu + row * 2 * K + g_col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu + row * 2 * K + u_col, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    s = tl.maximum(tl.max(tl.abs(y), 0), 1e-12) / 448.0
    tl.store(m8 + row * K + c, to_fp8(y / s, EXACT), mask=ok)
    tl.store(sm + row, s)


def swiglu_quant(gu: torch.Tensor, interleave: int = 0):
    """gu (N, 2K) = [gate | up] -> FP8 of silu(gate) * up (N, K) and per-token scales (N, 1). With `interleave`,
    gu's columns alternate between blocks of that many gate and up columns (fp8_gemm.interleave_gate_up)."""
    N, K2 = gu.shape
    K = K2 // 2
    if interleave and K % interleave:
        raise ValueError(f"interleave ({interleave}) must divide the {K} gate columns")
    m8 = torch.empty(N, K, device=gu.device, dtype=fp8.FP8)
    sm = torch.empty(N, 1, device=gu.device, dtype=torch.float32)
    _swiglu_quant_kernel[(N,)](gu, m8, sm, K, BLOCK_K=triton.next_power_of_2(K), EXACT=interpreting(), INTERLEAVE=interleave,
                               num_warps=8 if K >= 4096 else 4, **FP_FUSION)
    return m8, sm


@triton.jit
def _gated_sum_row(a, m, ga, gm, x, row, c, ok, K, HAS_X: tl.constexpr):
    """Columns c of row `row`: gate_a * a + gate_m * m (+ x), in float32."""
    out = (tl.load(ga + c, mask=ok, other=0.0).to(tl.float32) * tl.load(a + row * K + c, mask=ok, other=0.0).to(tl.float32)
           + tl.load(gm + c, mask=ok, other=0.0).to(tl.float32) * tl.load(m + row * K + c, mask=ok, other=0.0).to(tl.float32))
    if HAS_X:
        out += tl.load(x + row * K + c, mask=ok, other=0.0).to(tl.float32)
    return out


@triton.jit
def _gated_sum_kernel(a, m, ga, gm, x, y, K, HAS_X: tl.constexpr, BLOCK_K: tl.constexpr):
    row, pid = tl.program_id(0), tl.program_id(1)
    c = pid * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = c < K
    out = _gated_sum_row(a, m, ga, gm, x, row, c, ok, K, HAS_X)
    tl.store(y + row * K + c, out.to(y.dtype.element_ty), mask=ok)


def gated_sum(a: torch.Tensor, m: torch.Tensor, gate_a: torch.Tensor, gate_m: torch.Tensor, x: torch.Tensor | None = None):
    """gate_a * a + gate_m * m (+ x), rows of (N, K)."""
    N, K = a.shape
    y = torch.empty_like(x if x is not None else a)
    _gated_sum_kernel[(N, triton.cdiv(K, 1024))](a, m, gate_a, gate_m, x if x is not None else a, y, K,
                                                  HAS_X=x is not None, BLOCK_K=1024, **FP_FUSION)
    return y


@triton.jit
def _gated_sum_ln_quant_kernel(a, m, ga, gm, x, y, shift, scale, h8, sh, K, eps, BLOCK_K: tl.constexpr, EXACT: tl.constexpr,
                               PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_K)
    ok = c < K
    out = _gated_sum_row(a, m, ga, gm, x, row, c, ok, K, True).to(y.dtype.element_ty)
    tl.store(y + row * K + c, out, mask=ok)
    # the next block's LayerNorm reads the residual as stored
    _ln_mod_quant_row(out.to(tl.float32), c, ok, row, shift, scale, h8, sh, K, eps, EXACT)


def gated_sum_ln_quant(a: torch.Tensor, m: torch.Tensor, gate_a: torch.Tensor, gate_m: torch.Tensor, x: torch.Tensor,
                       shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6):
    """y = x + gate_a * a + gate_m * m (N, K), and what ln_modulate_quant(y, shift, scale) gives, in one pass:
    the residual of one block and the next block's FP8 input. Returns y, its FP8 (N, K) and scales (N, 1).

    One program a row, its row held in registers, 8 warps with no register cap: the fastest form of this join,
    which nothing runs beside, so its time is on the step's critical path (what was tried: docs/kernels.md)."""
    N, K = a.shape
    y = torch.empty_like(x)
    h8 = torch.empty(N, K, device=x.device, dtype=fp8.FP8)
    sh = torch.empty(N, 1, device=x.device, dtype=torch.float32)
    pdl, pdl_kw = pdl_launch(x.device)
    _gated_sum_ln_quant_kernel[(N,)](a, m, gate_a, gate_m, x, y, shift, scale, h8, sh, K, eps,
                                     BLOCK_K=triton.next_power_of_2(K), EXACT=interpreting(), PDL=pdl,
                                     num_warps=8 if K >= 4096 else 4, **FP_FUSION, **pdl_kw)
    return y, h8, sh


_branch_streams: dict[torch.device, torch.cuda.Stream] = {}


def branch_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU on which every block runs its MLP branch."""
    if device not in _branch_streams:
        _branch_streams[device] = torch.cuda.Stream(device)
    return _branch_streams[device]


def stacked_gains(block) -> torch.Tensor:
    """(3, H, D): the q, k, v norm gains, stacked once rather than at every call."""
    ws = (block.q_norm.weight, block.k_norm.weight, block.v_norm.weight)
    key = tuple((w.data_ptr(), w._version) for w in ws)
    cached = getattr(block, "_qkv_gains", None)
    if cached is None or cached[0] != key:
        cached = (key, torch.stack([w.detach() for w in ws]))
        block._qkv_gains = cached
    return cached[1]


def _version(t: torch.Tensor) -> int | None:
    """t's in-place version counter, or None for inference-mode tensors, which keep none."""
    return None if t.is_inference() else t._version


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class FusedPass:
    """What the fused blocks of a model share within one pass.

    - Every block's modulation (the pass's time modulation plus the block's own table), made in one
      add: (L, 4, dim), computed when the first block of a pass asks and reused by the others (they get
      the same `mod` object; it is held, so the next pass's cannot take its memory).
    - The next block's input, normalised and quantised by the kernel that makes this block's residual
      sum, handed over when the next block is called on exactly that residual.

    Both save launches on the step's critical path, each also a gap between nodes of its CUDA graph.
    Nothing is reused across the edge of a CUDA-graph capture (a graph must not read
    tensors made outside it that a later pass may replace), nor for inference-mode tensors, whose
    in-place changes cannot be seen."""

    def __init__(self, blocks) -> None:
        # The blocks' tables and norm eps, not the blocks: blocks refer to this object, and a reference
        # back would make a cycle that keeps a dropped model (and tensors of its CUDA graph) alive until gc.
        self.tables = [b.modulation for b in blocks]
        self.norm_eps = [b.norm.eps for b in blocks]
        self._stacked: torch.Tensor | None = None
        self._versions: list[tuple[int, int]] = []
        self._key: tuple | None = None  # (mod, its version, captured): what self._tables was made from
        self._tables: torch.Tensor | None = None
        self._handover: tuple | None = None  # (residual, its version, mod, its version, next index, captured, h8, sh)

    def modulation(self, index: int, mod: torch.Tensor) -> torch.Tensor:
        """(4, dim): shift, scale, gate_attn, gate_mlp of block `index` for the pass's `mod` (4, dim)."""
        table = self.tables[index]
        if self._stacked is None or self._versions[index] != (table.data_ptr(), table._version):
            stacked = torch.stack([t.detach() for t in self.tables])  # (L, 4, dim)
            if self._stacked is not None and self._stacked.shape == stacked.shape and not _capturing(stacked):
                self._stacked.copy_(stacked)  # in place: a graph captured earlier keeps reading live memory
            else:
                self._stacked = stacked
            self._versions = [(t.data_ptr(), t._version) for t in self.tables]
            self._key = None
        key = (mod, _version(mod), _capturing(mod))
        if self._key is None or key[0] is not self._key[0] or key[1:] != self._key[1:] or key[1] is None:
            self._tables = mod + self._stacked
            self._key = key
        return self._tables[index]

    def hand_over(self, residual: torch.Tensor, mod: torch.Tensor, index: int, h8: torch.Tensor, sh: torch.Tensor) -> None:
        """Keep block `index`'s input (h8, sh), made from `residual` under `mod`."""
        self._handover = (residual, _version(residual), mod, _version(mod), index, _capturing(residual), h8, sh)

    def take_over(self, x: torch.Tensor, mod: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h8, sh) made by the block before for block `index` on input `x` under `mod`, or None."""
        kept, self._handover = self._handover, None
        if (kept is None or kept[0] is not x or kept[2] is not mod or kept[4] != index or kept[5] != _capturing(x)
                or kept[1] is None or kept[1] != _version(x) or kept[3] is None or kept[3] != _version(mod)):
            return None
        return kept[6], kept[7]


def block_forward(block, x: torch.Tensor, mod: torch.Tensor, attend) -> torch.Tensor:
    """Block.forward for one frame (x (N, dim), mod (4, dim)) with FP8 linears, fused.

    With `block.branch_streams` (GPU), the MLP branch (MLP-in, SwiGLU, MLP-out) runs on a side stream
    beside the attention branch: the two share only their input, so the GEMMs may fill SMs that the
    attention's tail and the small kernels leave idle. CUDA graphs capture both streams (`lab.bench step` times
    both settings; docs/benchmarks.md). The MLP branch is launched first: its GEMM's tiles take the SMs and the
    attention branch fills in behind them. The products run on the frame's rows as they are (no padding), and
    the gated residual sum stays on its own kernel rather than in a GEMM's epilogue (what was tried:
    docs/kernels.md)."""
    # The modulation rows are made here, not inside the two kernels that read them (fewer registers and loads).
    shared, index = block.fused_pass
    shift, scale, gate_attn, gate_mlp = shared.modulation(index, mod).unbind(0)  # rows of a (4, dim) tensor: contiguous
    handed = shared.take_over(x, mod, index)
    h8, sh = handed if handed is not None else ln_modulate_quant(x, shift, scale, block.norm.eps)
    side = branch_stream(x.device) if block.branch_streams and x.is_cuda else None
    fused_combine = block.fused_combine is not None

    def mlp_branch():
        m8, sm = block.mlp_in.swiglu_quantized(h8, sh)
        return (m8, sm) if fused_combine else block.mlp_out.forward_quantized(m8, sm)

    if side is not None:
        here = torch.cuda.current_stream(x.device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            mlp = mlp_branch()
    H, D = block.q_norm.weight.shape  # heads local to this rank
    qkv = block.qkv.forward_quantized(h8, sh).view(-1, 3, H, D).permute(1, 2, 0, 3)  # (3, H, N, D) view
    a = attend(*qkv.unbind(0), head_norm=(stacked_gains(block), block.q_norm.eps), fp8_out=True)
    if isinstance(a, tuple):  # e4m3 (N, H*D) with its row scales: no quantisation pass before the GEMM
        a = block.attn_out.forward_quantized(*a)
    else:  # (H, N, D)
        a = block.attn_out(a.transpose(0, 1).flatten(-2))
    if side is not None:
        here.wait_stream(side)  # tensors made on the side stream are used here only after this join
    else:
        mlp = mlp_branch()
    if fused_combine:
        return x + block.fused_combine(*mlp, a, gate_attn, gate_mlp)
    if block.reduce_is_identity():
        if index + 1 == len(shared.tables):
            return gated_sum(a, mlp, gate_attn, gate_mlp, x)
        next_shift, next_scale = shared.modulation(index + 1, mod)[:2]
        y, next_h8, next_sh = gated_sum_ln_quant(a, mlp, gate_attn, gate_mlp, x, next_shift, next_scale,
                                                 shared.norm_eps[index + 1])
        shared.hand_over(y, mod, index + 1, next_h8, next_sh)
        return y
    return x + block.reduce(gated_sum(a, mlp, gate_attn, gate_mlp))
