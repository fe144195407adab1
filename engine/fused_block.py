"""The fused FP8 block: a block's one-frame inference forward around its FP8 GEMMs, in few launches.

`apply_fp8_kernels(model, ...)` swaps the blocks' big linears for FP8Linear and, with `fuse`, each
block for a `FusedBlock` built on the block's own parts (no copies): its forward for one frame
(x (N, dim), mod (4, dim), no grad) launches the kernels of engine/kernels/fused_block.py beside
the GEMMs and the attention; any other call takes the plain block's forward.

The per-head RMS norms of q, k and v go to the attend with their gains (`head_norm`): the FP8
ring cache applies them in the kernel that rotates, quantises and stores q, k, v. The block asks
the attend for its output in e4m3 (`fp8_out`): the FP8 ring's attention kernel writes it so, at a
scale that cannot saturate, and the out-projection reads it with no quantisation pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kernels.fp8_linear import quantize_linears_
from engine.kernels.fused_block import gated_sum, gated_sum_ln_quant, ln_modulate_quant
from engine.kernels.policy import block_gemm_kernels
from engine.model import Block, share_parts
from engine.parallel import Reduce, TensorParallelBlock

# (block, m8, sm, a, gate_attn, gate_mlp) -> the block's reduced output before the residual: MLP-out's GEMM from the
# quantised SwiGLU rows, the gated sum and the all-reduce in one call (engine/distributed.py's symmetric combine)
QuantizedCombine = Callable[..., torch.Tensor]


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


class FusedBlock(Block):
    """A block with FP8 linears whose one-frame inference forward runs fused; built on `block`'s parts.

    `shared`, `index`: the pass's FusedPass and this block's place in it. `branch_streams` (GPU): the MLP branch
    (MLP-in, SwiGLU, MLP-out) on a side stream beside the attention branch. `reduce`: a tensor-parallel block's
    sum over the ranks (None: a single device). `combine_quantized`: MLP-out, gated sum and reduction in one call.
    """

    def __init__(self, block: Block, shared: FusedPass, index: int, *, branch_streams: bool = False,
                 reduce: Reduce | None = None, combine_quantized: QuantizedCombine | None = None):
        share_parts(self, block)
        self.shared, self.index = shared, index
        self.branch_streams = branch_streams
        self.reduce = reduce
        self.combine_quantized = combine_quantized

    def variant(self, **changes) -> FusedBlock:
        """A FusedBlock on the same parts and pass with some settings changed (FusedBlock's keywords)."""
        settings = dict(branch_streams=self.branch_streams, reduce=self.reduce, combine_quantized=self.combine_quantized)
        return FusedBlock(self, self.shared, self.index, **{**settings, **changes})

    def forward(self, x: torch.Tensor, mod: torch.Tensor, attend: Callable) -> torch.Tensor:
        if x.ndim == 2 and mod.ndim == 2 and not torch.is_grad_enabled():
            return self.fused_forward(x, mod, attend)
        return super().forward(x, mod, attend)

    def combine(self, a: torch.Tensor, s: torch.Tensor, gate_attn: torch.Tensor, gate_mlp: torch.Tensor) -> torch.Tensor:
        y = super().combine(a, s, gate_attn, gate_mlp)
        return y if self.reduce is None else self.reduce(y)

    def fused_forward(self, x: torch.Tensor, mod: torch.Tensor, attend: Callable) -> torch.Tensor:
        """Block.forward for one frame (x (N, dim), mod (4, dim)) with FP8 linears, fused.

        With `branch_streams` (GPU), the MLP branch runs on a side stream beside the attention branch: the two
        share only their input, so the GEMMs may fill SMs that the attention's tail and the small kernels leave
        idle. CUDA graphs capture both streams. The MLP branch is launched first: its GEMM's tiles take the SMs
        and the attention branch fills in behind them. The products run on the frame's rows as they are (no
        padding), and the gated residual sum stays a kernel of its own rather than a GEMM's epilogue
        (docs/kernels.md)."""
        # The modulation rows are made here, not inside the two kernels that read them (fewer registers and loads).
        shared, index = self.shared, self.index
        shift, scale, gate_attn, gate_mlp = shared.modulation(index, mod).unbind(0)  # rows of a (4, dim) tensor: contiguous
        handed = shared.take_over(x, mod, index)
        h8, sh = handed if handed is not None else ln_modulate_quant(x, shift, scale, self.norm.eps)
        side = branch_stream(x.device) if self.branch_streams and x.is_cuda else None
        combined = self.combine_quantized is not None

        def mlp_branch():
            m8, sm = self.mlp_in.swiglu_quantized(h8, sh)
            return (m8, sm) if combined else self.mlp_out.forward_quantized(m8, sm)

        if side is not None:
            here = torch.cuda.current_stream(x.device)
            side.wait_stream(here)
            with torch.cuda.stream(side):
                mlp = mlp_branch()
        H, D = self.q_norm.weight.shape  # heads local to this rank
        qkv = self.qkv.forward_quantized(h8, sh).view(-1, 3, H, D).permute(1, 2, 0, 3)  # (3, H, N, D) view
        a = attend(*qkv.unbind(0), head_norm=(stacked_gains(self), self.q_norm.eps), fp8_out=True)
        if isinstance(a, tuple):  # e4m3 (N, H*D) with its row scales: no quantisation pass before the GEMM
            a = self.attn_out.forward_quantized(*a)
        else:  # (H, N, D)
            a = self.attn_out(a.transpose(0, 1).flatten(-2))
        if side is not None:
            here.wait_stream(side)  # tensors made on the side stream are used here only after this join
        else:
            mlp = mlp_branch()
        if combined:
            return x + self.combine_quantized(self, *mlp, a, gate_attn, gate_mlp)
        if self.reduce is None:
            if index + 1 == len(shared.tables):
                return gated_sum(a, mlp, gate_attn, gate_mlp, x)
            next_shift, next_scale = shared.modulation(index + 1, mod)[:2]
            y, next_h8, next_sh = gated_sum_ln_quant(a, mlp, gate_attn, gate_mlp, x, next_shift, next_scale,
                                                     shared.norm_eps[index + 1])
            shared.hand_over(y, mod, index + 1, next_h8, next_sh)
            return y
        return x + self.reduce(gated_sum(a, mlp, gate_attn, gate_mlp))


def apply_fp8_kernels(model, *, fuse: bool = True, branch_streams: bool = True, fast_accum: bool = False,
                      gemm_kernels: dict[str, str] | None = None):
    """The blocks' big linears swapped for FP8Linear (`fast_accum`: as quantize_linears_ takes it; `gemm_kernels`:
    the FP8 product's kernel per linear name over the policy's defaults, as policy.block_gemm_kernels takes them),
    in place; with `fuse`, each block swapped for a FusedBlock on its own parts, one FusedPass shared by all
    (`branch_streams`: each block's MLP branch on a side stream, on a GPU). A tensor-parallel block keeps its
    reduction. Returns the model."""
    quantize_linears_(model, fast_accum=fast_accum, gemm_kernels=block_gemm_kernels(model, gemm_kernels))
    if not fuse:
        return model
    shared = FusedPass(model.blocks)
    for index, block in enumerate(model.blocks):
        reduce = block.reduce if isinstance(block, (TensorParallelBlock, FusedBlock)) else None
        model.blocks[index] = FusedBlock(block, shared, index, branch_streams=branch_streams, reduce=reduce)
    return model
