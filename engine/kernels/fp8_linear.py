"""FP8 linear layers: per-token activation scales x per-channel weight scales.

y = (x8 @ w8ᵀ) * sx[:, None] * sw[None, :], with x8 = x / sx and w8 = w / sw in e4m3,
sx the absmax of each token's row / 448 and sw the absmax of each output channel /
448. On Hopper the product is `torch._scaled_mm` with row-wise scales; the activation
quantisation is one Triton pass over x. Elsewhere (CPU) the same function runs as a
dequantised float matmul, the reference the GPU path is held to. Which kernel each block linear's product runs
on is policy.py's.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl
from torch import nn

from engine import fp8
from engine.kernels.common import to_fp8, wait_for_previous_kernel
from engine.kernels.fp8_gemm import FP8GEMM, interleave_gate_up
from engine.kernels.fused_block import swiglu_quant
from engine.kernels.launch import FP_FUSION, interpreting, pdl_launch

log = logging.getLogger("talkloop.kernels")

FP8_GEMM_KERNELS = ("cublas", "triton")  # torch._scaled_mm | engine/kernels/fp8_gemm.py


@triton.jit
def _quant_rows_kernel(x, x8, sx, K, s_x, BLOCK_K: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    ok = cols < K
    v = tl.load(x + row * s_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), 0), 1e-12) / 448.0
    tl.store(x8 + row * K + cols, to_fp8(v / scale, EXACT), mask=ok)
    tl.store(sx + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> e4m3 (M, K) and per-row scales (M, 1) float32."""
    M, K = x.shape
    assert x.stride(1) == 1
    x8 = torch.empty(M, K, device=x.device, dtype=fp8.FP8)
    sx = torch.empty(M, 1, device=x.device, dtype=torch.float32)
    pdl, pdl_kw = pdl_launch(x.device)
    _quant_rows_kernel[(M,)](x, x8, sx, K, x.stride(0), BLOCK_K=triton.next_power_of_2(K), EXACT=interpreting(),
                             PDL=pdl, num_warps=8 if K >= 4096 else 4, **FP_FUSION, **pdl_kw)
    return x8, sx


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sx = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / fp8.FP8_MAX
    return (x.float() / sx).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), sx


class FP8Linear(nn.Module):
    """A bias-free nn.Linear with e4m3 weights and per-output-channel scales."""

    def __init__(self, linear: nn.Linear, use_scaled_mm: bool | None = None, fast_accum: bool = False,
                 gemm_kernel: str = "cublas", gate_up_block: int = 0, block_n: int | None = None):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("FP8Linear takes bias-free linears")
        w = linear.weight.detach()
        # A [gate; up] linear may store its rows interleaved in blocks of `gate_up_block`
        # (fp8_gemm.interleave_gate_up): the order the Triton kernel's SwiGLU form reads. Outputs keep
        # the [gate | up] order either way; only `swiglu_quantized` reads the stored order directly.
        if gate_up_block:
            w = interleave_gate_up(w, gate_up_block)
        self.gate_up_block = gate_up_block
        sw = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / fp8.FP8_MAX  # (N, 1)
        self.register_buffer("weight8", (w.float() / sw).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8))
        self.register_buffer("weight_scale", sw.t().contiguous())  # (1, N)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        on_hopper = w.is_cuda and torch.cuda.get_device_capability(w.device) >= (8, 9)
        self.use_scaled_mm = on_hopper if use_scaled_mm is None else use_scaled_mm
        # Tensor-core FP8 accumulation without the periodic promotion to float32 (faster, less exact;
        # what FP8 inference stacks use for forward GEMMs). GPU only.
        self.fast_accum = fast_accum
        # The GPU's FP8 product: "cublas" (torch._scaled_mm) or "triton" (fp8_gemm.py, which also has the
        # SwiGLU form: `swiglu_quantized`)
        if gemm_kernel not in FP8_GEMM_KERNELS:
            raise ValueError(f"gemm_kernel must be one of {', '.join(FP8_GEMM_KERNELS)}, got {gemm_kernel!r}")
        self.gemm_kernel = gemm_kernel
        # The Triton kernel's output tile width in its plain form (`plain_block_n` of the output width unless given)
        self.block_n = plain_block_n(self.out_features) if block_n is None else block_n
        self._launchers: dict[tuple[bool, bool, int], object] = {}  # by (swiglu, fast_accum, block_n): each may be changed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.use_scaled_mm:
            y = self.forward_quantized(*quantize_rows(x2 if x2.stride(1) == 1 else x2.contiguous()))
        else:
            y = self.forward_quantized(*quantize_rows_reference(x2)).to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def _triton_gemm(self, swiglu: bool):
        key = (swiglu, self.fast_accum, self.block_n)
        if key not in self._launchers:
            self._launchers[key] = FP8GEMM(self.weight8, self.weight_scale, swiglu=swiglu, fast_accum=self.fast_accum,
                                           block_n=self.gate_up_block if swiglu else self.block_n)
        return self._launchers[key]

    def _stored_order_product(self, x8: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        """(M, N) bf16, its columns in the weight's stored row order."""
        if self.use_scaled_mm and self.gemm_kernel == "triton":
            return self._triton_gemm(False)(x8, sx)
        if self.use_scaled_mm:
            return torch._scaled_mm(x8, self.weight8.t(), scale_a=sx, scale_b=self.weight_scale, out_dtype=torch.bfloat16,
                                    use_fast_accum=self.fast_accum)
        return ((x8.float() * sx) @ (self.weight8.float() * self.weight_scale.t()).t()).to(torch.bfloat16)

    def forward_quantized(self, x8: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        """Already-quantised activations (M, K) e4m3 with per-row scales (M, 1) -> (M, N) bf16."""
        y = self._stored_order_product(x8, sx)
        if self.gate_up_block:  # back to [gate | up]
            y = y.unflatten(-1, (-1, 2, self.gate_up_block)).transpose(-3, -2).flatten(-3)
        return y

    def swiglu_quantized(self, x8: torch.Tensor, sx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For a [gate | up] linear (out_features 2H): silu(gate) * up of the product, (M, H), as per-row FP8 and
        scales (M, 1). The Triton kernel forms it in the product's epilogue, so the (M, 2H) product is never
        stored; otherwise the product is stored in bf16 and a fused pass reads it back."""
        if not self.use_scaled_mm:  # the reference: the product in [gate | up] order
            return swiglu_quant(self.forward_quantized(x8, sx))
        y = self.swiglu_product(x8, sx)
        return quantize_rows(y) if self._swiglu_in_epilogue() else swiglu_quant(y, interleave=self.gate_up_block)

    def _swiglu_in_epilogue(self) -> bool:
        return self.use_scaled_mm and self.gemm_kernel == "triton" and bool(self.gate_up_block)

    def swiglu_product(self, x8: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        """The GEMM part of `swiglu_quantized` (GPU): silu(gate) * up (M, H) from the Triton kernel's SwiGLU
        form, or else the (M, 2H) product in the weight's stored row order."""
        return self._triton_gemm(True)(x8, sx) if self._swiglu_in_epilogue() else self._stored_order_product(x8, sx)


BLOCK_LINEARS = ("qkv", "attn_out", "mlp_in", "mlp_out")  # the block linears FP8 serves
GEMM_WORKSPACE_ENV = "CUBLASLT_WORKSPACE_SIZE"  # KiB; torch reads it at its first cuBLASLt call in a process


def prefer_static_gemm_schedule() -> bool:
    """Run cuBLASLt without a workspace, unless the user set its size: its FP8 kernels at the step's
    shapes then use a static tile schedule instead of a dynamic one whose counter is zeroed by a
    memset before every call (a graph node, and a launch gap, per GEMM; docs/kernels.md). Torch reads the setting at
    its first cuBLASLt call in the process and keeps it for every cuBLASLt GEMM after, so it
    takes effect only if no GEMM ran on the GPU before; returns whether this call set it."""
    if os.environ.get(GEMM_WORKSPACE_ENV) is not None:
        return False
    os.environ[GEMM_WORKSPACE_ENV] = "0"
    log.info("asked for cuBLASLt without a workspace (%s=0: statically scheduled FP8 GEMMs, no memset per call); "
             "it holds unless this process ran a GEMM on the GPU before", GEMM_WORKSPACE_ENV)
    return True


SWIGLU_BLOCK = 128  # MLP-in's gate/up interleave: the Triton SwiGLU form's output tile width
PLAIN_BLOCK = 256  # the Triton plain form's output tile width where the output tiles in it (128 elsewhere)


def plain_block_n(out_features: int) -> int:
    """The Triton plain form's output tile width for an output of `out_features` columns."""
    return PLAIN_BLOCK if out_features % PLAIN_BLOCK == 0 else 128


def swiglu_block(out_features: int) -> int:
    """The gate/up interleave a [gate | up] linear of `out_features` rows takes: SWIGLU_BLOCK where both halves
    tile in it, else 0 (stored as built; the SwiGLU form cannot read it)."""
    return SWIGLU_BLOCK if out_features % (2 * SWIGLU_BLOCK) == 0 else 0


def linear_widths(block: nn.Module) -> dict[str, int]:
    """A block's linears' output widths by name, what policy.default_gemm_kernels chooses by."""
    return {name: getattr(block, name).out_features for name in BLOCK_LINEARS}


def quantize_linears_(model: nn.Module, fast_accum: bool = False, gemm_kernels: dict[str, str] | None = None) -> nn.Module:
    """Swap the blocks' big linears for FP8Linear, in place (the fused block that runs them around its own kernels:
    engine/fused_block.py's apply_fp8_kernels). `fast_accum`: FP8 GEMMs with the tensor cores' fast accumulation
    (GPU only); `gemm_kernels`: the FP8 product's kernel per linear name (FP8_GEMM_KERNELS; cuBLAS for a linear not
    named), as policy.block_gemm_kernels chooses them."""
    gemm_kernels = gemm_kernels or {}
    if unknown := set(gemm_kernels) - set(BLOCK_LINEARS):
        raise ValueError(f"gemm_kernels names {sorted(unknown)}; the block linears are {', '.join(BLOCK_LINEARS)}")
    if any(p.is_cuda for p in model.parameters()):
        prefer_static_gemm_schedule()
    for block in model.blocks:
        for name in BLOCK_LINEARS:
            linear = getattr(block, name)
            if not isinstance(linear, FP8Linear):
                # MLP-in's gate and up rows interleaved where they tile (the Triton kernel's SwiGLU form reads them so)
                setattr(block, name, FP8Linear(linear, fast_accum=fast_accum, gemm_kernel=gemm_kernels.get(name, "cublas"),
                                               gate_up_block=swiglu_block(linear.out_features) if name == "mlp_in" else 0))
    return model
