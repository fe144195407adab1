"""A block's elementwise work fused around its FP8 GEMMs (serving path, inference only).

The plain block (engine/model.py) runs ~35 small kernels per pass; the fused block runs 3 of
these beside the GEMMs and attention:

    ln_modulate_quant   LayerNorm -> (1 + scale), + shift -> per-token FP8, shared by q/k/v and MLP-in
    swiglu_quant        silu(gate) * up -> per-token FP8 for MLP-out (where MLP-in runs on the Triton
                        GEMM, its epilogue forms silu(gate) * up: FP8Linear.swiglu_quantized)
    gated_sum           gate_attn * a + gate_mlp * m (+ x when there is no all-reduce between)

and where no all-reduce sits between blocks, `gated_sum_ln_quant` makes a block's residual
and the next block's FP8 input in one pass, so the next block skips its `ln_modulate_quant`.

The block that launches them is engine/fused_block.py. Each launcher has its plain PyTorch
reference here (`*_reference`), which tests/kernels/test_fused_block.py holds it to (on the CPU
under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine import fp8
from engine.kernels.common import to_fp8, wait_for_previous_kernel
from engine.kernels.launch import FP_FUSION, interpreting, pdl_launch


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


def _rows_to_fp8(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float rows (N, K) -> e4m3 (N, K) and per-row scales (N, 1): absmax / 448, as the kernels scale."""
    s = h.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / fp8.FP8_MAX
    return (h.float() / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), s


def ln_modulate_quant_reference(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6):
    """What ln_modulate_quant computes, in PyTorch (float32)."""
    h = F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * (1 + scale.float()) + shift.float()
    return _rows_to_fp8(h)


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


def swiglu_quant_reference(gu: torch.Tensor):
    """What swiglu_quant computes on [gate | up] columns, in PyTorch (float32)."""
    gate, up = gu.float().chunk(2, dim=-1)
    return _rows_to_fp8(F.silu(gate) * up)


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


def gated_sum_reference(a: torch.Tensor, m: torch.Tensor, gate_a: torch.Tensor, gate_m: torch.Tensor,
                        x: torch.Tensor | None = None):
    """What gated_sum computes, in PyTorch (float32, stored in the output's type)."""
    out = gate_a.float() * a.float() + gate_m.float() * m.float()
    return (out + x.float() if x is not None else out).to((x if x is not None else a).dtype)


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

    One program a row, its row held in registers, 8 warps with no register cap: this join runs beside nothing,
    so its time is on the step's critical path (other forms: docs/kernels.md)."""
    N, K = a.shape
    y = torch.empty_like(x)
    h8 = torch.empty(N, K, device=x.device, dtype=fp8.FP8)
    sh = torch.empty(N, 1, device=x.device, dtype=torch.float32)
    pdl, pdl_kw = pdl_launch(x.device)
    _gated_sum_ln_quant_kernel[(N,)](a, m, gate_a, gate_m, x, y, shift, scale, h8, sh, K, eps,
                                     BLOCK_K=triton.next_power_of_2(K), EXACT=interpreting(), PDL=pdl,
                                     num_warps=8 if K >= 4096 else 4, **FP_FUSION, **pdl_kw)
    return y, h8, sh


def gated_sum_ln_quant_reference(a: torch.Tensor, m: torch.Tensor, gate_a: torch.Tensor, gate_m: torch.Tensor,
                                 x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6):
    """What gated_sum_ln_quant computes, in PyTorch: the residual as stored, then its normalised FP8 rows."""
    y = gated_sum_reference(a, m, gate_a, gate_m, x)
    return (y, *ln_modulate_quant_reference(y, shift, scale, eps))
