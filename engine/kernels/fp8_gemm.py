"""FP8 GEMM with per-row x per-column scales (Triton, persistent, TMA), and its SwiGLU form.

    y = (x8 @ w8ᵀ) * sx * sw                                  (M, N) bf16
    swiglu: w8 = gate and up rows (2N, K) interleaved in blocks of block_n (`interleave_gate_up`)
            -> y = silu(x·gateᵀ) * (x·upᵀ)                      (M, N) bf16

One program per SM walks the output tiles in groups of GROUP_M row tiles (so the weight tiles it
reads are shared in L2) with the loop over tiles and k-blocks flattened, so the next tile's loads
run under this tile's epilogue. In the SwiGLU form each program multiplies the gate and the up
tile of the same columns from one x tile and writes only their product: the (M, 2N) pre-activation
that cuBLAS would write and the SwiGLU pass read back never exists (half the bytes each way).

On Hopper the engine serves MLP-in with the SwiGLU form, and q/k/v, the attention's out-projection and MLP-out
with the plain form in 128x256 tiles where all three outputs tile in 256 columns (FP8Linear; cuBLAS,
`torch._scaled_mm`, elsewhere). Where the tiles fall short of a whole last round of SMs, the other branch's
kernels fill the SMs that round leaves, so one program per SM over every tile serves (docs/kernels.md).
On the CPU it runs under TRITON_INTERPRET=1; `fp8_gemm_reference` is the plain PyTorch computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.common import round_to, wait_for_previous_kernel
from engine.kernels.launch import FP_FUSION, interpreting, pdl_launch


@triton.jit
def _tile(t, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile t's (row tile, column tile): GROUP_M row tiles sweep each column tile in turn."""
    width = GROUP_M * num_n
    first_m = (t // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % width) % rows, (t % width) // rows


@triton.jit
def _fp8_gemm_kernel(x_desc, w_desc, y_desc, sx, sw, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, SWIGLU: tl.constexpr,
                     PROMOTE_EVERY: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_blocks = tl.cdiv(K, BLOCK_K)
    for t in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True):
        pm, pn = _tile(t, num_m, num_n, GROUP_M)
        off_m = pm * BLOCK_M
        off_n = pn * BLOCK_N
        W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N  # SwiGLU: BLOCK_N gate rows, then their up rows
        acc = tl.zeros((BLOCK_M, W_ROWS), dtype=tl.float32)
        for kb in range(k_blocks):
            x = x_desc.load([off_m, kb * BLOCK_K])  # (BLOCK_M, BLOCK_K) e4m3; rows past M read as zeros
            acc = tl.dot(x, w_desc.load([pn * W_ROWS, kb * BLOCK_K]).T, acc, max_num_imprecise_acc=PROMOTE_EVERY)
        rows = off_m + tl.arange(0, BLOCK_M)
        row_scale = tl.load(sx + rows, mask=rows < M, other=0.0)[:, None]
        y = acc * row_scale * tl.load(sw + pn * W_ROWS + tl.arange(0, W_ROWS))[None, :]
        if SWIGLU:
            gate, up = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
            y = gate / (1.0 + tl.exp(tl.minimum(-gate, 80.0))) * up  # silu; e^80 keeps clear of float32's overflow
        y_desc.store([off_m, off_n], round_to(y, tl.bfloat16, EXACT).to(tl.bfloat16))  # rows past M are dropped


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


class FP8GEMM:
    """Launcher for one weight: y = (x8, sx) -> product, with w8 (N, K) e4m3 and sw (N,) float32; with `swiglu`,
    w8 (2N, K) holds gate and up rows interleaved in blocks of block_n (`interleave_gate_up`) and sw follows them.
    `fast_accum`: the tensor cores' FP8 accumulation throughout (Triton's default on Hopper); otherwise
    promoted to float32 once per k-block, as cuBLAS does without fast accumulation.
    The weight's TMA descriptor is made once; x's and y's at each call (a descriptor holds its tensor, so
    keeping them would keep every output alive)."""

    def __init__(self, w8: torch.Tensor, sw: torch.Tensor, swiglu: bool = False, fast_accum: bool = True,
                 block_m: int = 128, block_n: int = 128, block_k: int = 128, group_m: int = 8, stages: int | None = None,
                 num_warps: int = 8, persistent: bool = True):
        if w8.dtype != torch.float8_e4m3fn or w8.dim() != 2 or not w8.is_contiguous():
            raise ValueError(f"w8 must be a contiguous 2-d float8_e4m3fn tensor, got {w8.dtype} {tuple(w8.shape)}")
        rows, self.K = w8.shape
        if swiglu and rows % 2:
            raise ValueError(f"the SwiGLU form takes gate and up rows: an even number of rows, got {rows}")
        self.N = rows // 2 if swiglu else rows
        if self.N % block_n or self.K % 16:  # whole column tiles (the up rows start at row N); 16-byte TMA rows
            raise ValueError(f"output columns ({self.N}) must be a multiple of block_n ({block_n}) and K ({self.K}) of 16")
        if sw.numel() != rows:
            raise ValueError(f"sw must hold one scale per weight row ({rows}), got {sw.numel()}")
        self.w8, self.sw = w8, sw.reshape(-1).float().contiguous()
        self.swiglu, self.fast_accum = swiglu, fast_accum
        self.block_m, self.block_n, self.block_k, self.group_m = block_m, block_n, block_k, group_m
        # shared memory per stage: one x tile and one weight tile of 2 * block_n rows (SwiGLU) or block_n; past 128
        # weight rows, 3 stages and the output tile fill a block's shared memory
        self.stages = stages if stages is not None else (3 if swiglu or block_n > 128 else 4)
        self.num_warps = num_warps
        self.persistent = persistent  # one program per SM walking tiles; else one program per tile
        self._w_desc = None

    def __call__(self, x8: torch.Tensor, sx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x8 (M, K) e4m3, sx (M, 1) float32 -> (M, N) bf16."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        M, K = x8.shape
        if K != self.K or x8.dtype != torch.float8_e4m3fn or x8.stride(1) != 1:
            raise ValueError(f"x8 must be float8_e4m3fn (M, {self.K}) with contiguous rows, got {x8.dtype} {tuple(x8.shape)}")
        if out is None:
            out = torch.empty(M, self.N, device=x8.device, dtype=torch.bfloat16)
        elif out.shape != (M, self.N) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous bf16 ({M}, {self.N}), got {out.dtype} {tuple(out.shape)}")
        if self._w_desc is None:
            self._w_desc = TensorDescriptor.from_tensor(self.w8, [self.block_n * (2 if self.swiglu else 1), self.block_k])
        x_desc = TensorDescriptor.from_tensor(x8, [self.block_m, self.block_k])
        y_desc = TensorDescriptor.from_tensor(out, [self.block_m, self.block_n])
        tiles = triton.cdiv(M, self.block_m) * (self.N // self.block_n)
        programs = min(tiles, _sm_count(x8.device)) if self.persistent else tiles
        pdl, pdl_kw = pdl_launch(x8.device)
        _fp8_gemm_kernel[(programs,)](x_desc, self._w_desc, y_desc, sx, self.sw, M, self.N, K, BLOCK_M=self.block_m,
                                      BLOCK_N=self.block_n, BLOCK_K=self.block_k, GROUP_M=self.group_m,
                                      PROGRAMS=programs, SWIGLU=self.swiglu,
                                      PROMOTE_EVERY=None if self.fast_accum else self.block_k, EXACT=interpreting(),
                                      PDL=pdl, num_stages=self.stages, num_warps=self.num_warps, **FP_FUSION, **pdl_kw)
        return out


def interleave_gate_up(w: torch.Tensor, block_n: int = 128) -> torch.Tensor:
    """Rows [gate; up] (2N, ...) -> blocks of block_n gate rows each followed by the same columns' up rows,
    the order the SwiGLU form reads (one weight tile holds both halves of its output columns)."""
    gate, up = w.chunk(2, dim=0)
    if gate.shape[0] % block_n:
        raise ValueError(f"the gate rows ({gate.shape[0]}) must be a multiple of block_n ({block_n})")
    blocks = lambda t: t.reshape(-1, block_n, *t.shape[1:])
    return torch.stack([blocks(gate), blocks(up)], dim=1).reshape(w.shape)


def fp8_gemm_reference(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
                       swiglu: bool = False) -> torch.Tensor:
    """The same product dequantised, in float32 (rounded to bf16 at the end, as the kernel stores it)."""
    y = (x8.float() * sx.reshape(-1, 1).float()) @ (w8.float() * sw.reshape(-1, 1).float()).t()
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y.to(torch.bfloat16)
