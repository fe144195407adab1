"""Tensor parallelism, applied from outside the model (which stays single-device).

A rank keeps its share of the heads and of the MLP: q/k/v and the MLP's gate/up
projection split by output rows (column-parallel), the attention and MLP output
projections split by input columns (row-parallel). A block's attention and MLP
outputs are then partial sums, added and reduced once: `apply_tensor_parallel` shards the
weights in place and swaps each block for a `TensorParallelBlock`, whose combine all-reduces.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.model import Block, CausalVideoDiT, share_parts


Reduce = Callable[[torch.Tensor], torch.Tensor]  # sums a block's partial output over the ranks, in place or not


class TensorParallelBlock(Block):
    """A sharded block whose combine sums its partial output over the ranks with `reduce`; built on `block`'s own
    parts (no copies)."""

    def __init__(self, block: Block, reduce: Reduce):
        share_parts(self, block)
        self.reduce = reduce

    def combine(self, a: torch.Tensor, s: torch.Tensor, gate_attn: torch.Tensor, gate_mlp: torch.Tensor) -> torch.Tensor:
        return self.reduce(super().combine(a, s, gate_attn, gate_mlp))


def _keep(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data.contiguous(), requires_grad=param.requires_grad)


def shard_block_(block: Block, rank: int, world: int) -> None:
    """Keep rank's heads and MLP columns of `block`, in place."""
    H, D = block.q_norm.weight.shape
    hidden = block.mlp_out.weight.shape[1]
    if H % world or hidden % world:
        raise ValueError(f"tensor-parallel degree {world} must divide heads ({H}) and MLP width ({hidden})")
    heads = slice(rank * H // world, (rank + 1) * H // world)
    cols = slice(rank * hidden // world, (rank + 1) * hidden // world)
    dim = block.qkv.weight.shape[1]
    block.qkv.weight = _keep(block.qkv.weight, block.qkv.weight.view(3, H, D, dim)[:, heads].reshape(-1, dim))
    block.attn_out.weight = _keep(block.attn_out.weight, block.attn_out.weight.view(dim, H, D)[:, heads].reshape(dim, -1))
    block.mlp_in.weight = _keep(block.mlp_in.weight, block.mlp_in.weight.view(2, hidden, dim)[:, cols].reshape(-1, dim))
    block.mlp_out.weight = _keep(block.mlp_out.weight, block.mlp_out.weight[:, cols])
    for norm in (block.q_norm, block.k_norm, block.v_norm):
        norm.weight = _keep(norm.weight, norm.weight[heads])
    for lin in (block.qkv, block.attn_out, block.mlp_in, block.mlp_out):
        lin.in_features, lin.out_features = lin.weight.shape[1], lin.weight.shape[0]


def apply_tensor_parallel(model: CausalVideoDiT, rank: int, world: int, reduce: Reduce | None = None) -> CausalVideoDiT:
    """Shard every block for `rank` of `world`, in place; with `reduce` (what sums partial block outputs across
    ranks), each block is swapped for a TensorParallelBlock on its sharded parts. Without, the blocks stay plain:
    one rank's share, its reduction left out (timing a shard alone)."""
    for index, block in enumerate(model.blocks):
        shard_block_(block, rank, world)
        if reduce is not None:
            model.blocks[index] = TensorParallelBlock(block, reduce)
    return model
