"""FP8 linear layers: per-token activation scales x per-channel weight scales.

y = (x8 @ w8ᵀ) * sx[:, None] * sw[None, :], with x8 = x / sx and w8 = w / sw in e4m3,
sx the absmax of each token's row / 448 and sw the absmax of each output channel /
448. On Hopper the product is `torch._scaled_mm` with row-wise scales; the activation
quantisation is one Triton pass over x. Elsewhere (CPU) the same function runs as a
dequantised float matmul, the reference the GPU path is held to.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl
from torch import nn

from engine import fp8
from engine.kernels import interpreting
from engine.kernels.common import to_fp8

log = logging.getLogger("talkloop.kernels")


@triton.jit
def _quant_rows_kernel(x, x8, sx, K, s_x, BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
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
    _quant_rows_kernel[(M,)](x, x8, sx, K, x.stride(0), BLOCK_K=triton.next_power_of_2(K), EXACT=interpreting(),
                             num_warps=8 if K >= 4096 else 4)
    return x8, sx


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sx = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / fp8.FP8_MAX
    return (x.float() / sx).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), sx


class FP8Linear(nn.Module):
    """A bias-free nn.Linear with e4m3 weights and per-output-channel scales."""

    def __init__(self, linear: nn.Linear, use_scaled_mm: bool | None = None, fast_accum: bool = False):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("FP8Linear takes bias-free linears")
        w = linear.weight.detach()
        sw = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / fp8.FP8_MAX  # (N, 1)
        self.register_buffer("weight8", (w.float() / sw).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8))
        self.register_buffer("weight_scale", sw.t().contiguous())  # (1, N)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        on_hopper = w.is_cuda and torch.cuda.get_device_capability(w.device) >= (8, 9)
        self.use_scaled_mm = on_hopper if use_scaled_mm is None else use_scaled_mm
        # Tensor-core FP8 accumulation without the periodic promotion to float32 (faster, less exact;
        # what FP8 inference stacks use for forward GEMMs). Only `torch._scaled_mm` has it.
        self.fast_accum = fast_accum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.use_scaled_mm:
            y = self.forward_quantized(*quantize_rows(x2 if x2.stride(1) == 1 else x2.contiguous()))
        else:
            y = self.forward_quantized(*quantize_rows_reference(x2)).to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def forward_quantized(self, x8: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        """Already-quantised activations (M, K) e4m3 with per-row scales (M, 1) -> (M, N) bf16."""
        if self.use_scaled_mm:
            return torch._scaled_mm(x8, self.weight8.t(), scale_a=sx, scale_b=self.weight_scale, out_dtype=torch.bfloat16,
                                    use_fast_accum=self.fast_accum)
        return ((x8.float() * sx) @ (self.weight8.float() * self.weight_scale.t()).t()).to(torch.bfloat16)


BLOCK_LINEARS = ("qkv", "attn_out", "mlp_in", "mlp_out")  # the block linears FP8 serves
GEMM_WORKSPACE_ENV = "CUBLASLT_WORKSPACE_SIZE"  # KiB; torch reads it at its first cuBLASLt call in a process


def prefer_static_gemm_schedule() -> bool:
    """Run cuBLASLt without a workspace, unless the user set its size: its FP8 kernels at the step's
    shapes then use a static tile schedule instead of a dynamic one whose counter is zeroed by a
    memset before every call (a graph node, and a launch gap, per GEMM: 960 a step for the 57b
    shard; on one H200 the step took 2 ms less, docs/benchmarks.md). Torch reads the setting at
    its first cuBLASLt call in the process and keeps it for every cuBLASLt GEMM after, so it
    takes effect only if no GEMM ran on the GPU before; returns whether this call set it."""
    if os.environ.get(GEMM_WORKSPACE_ENV) is not None:
        return False
    os.environ[GEMM_WORKSPACE_ENV] = "0"
    log.info("asked for cuBLASLt without a workspace (%s=0: statically scheduled FP8 GEMMs, no memset per call); "
             "it holds unless this process ran a GEMM on the GPU before", GEMM_WORKSPACE_ENV)
    return True


def quantize_linears_(model: nn.Module, fuse: bool = True, branch_streams: bool = True, fast_accum: bool = False) -> nn.Module:
    """Swap the blocks' big linears for FP8Linear, in place; with `fuse`, run blocks through the fused kernels
    (on a GPU with `branch_streams`, each block's MLP branch on a side stream beside its attention);
    `fast_accum`: FP8 GEMMs with the tensor cores' fast accumulation (GPU only)."""
    from engine.kernels.fused_block import FusedPass, block_forward

    if any(p.is_cuda for p in model.parameters()):
        prefer_static_gemm_schedule()
    shared = FusedPass(model.blocks)
    for index, block in enumerate(model.blocks):
        block.fused_pass = (shared, index)
        for name in BLOCK_LINEARS:
            if not isinstance(getattr(block, name), FP8Linear):
                setattr(block, name, FP8Linear(getattr(block, name), fast_accum=fast_accum))
        block.fused_forward = block_forward if fuse else None
        block.branch_streams = fuse and branch_streams
    return model
