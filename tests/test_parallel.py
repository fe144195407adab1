"""Tensor-parallel sharding: the shards' partial block outputs sum to the full block's; the swap shares parameters."""

import copy

import pytest
import torch

from engine.cache import attention
from engine.parallel import TensorParallelBlock, apply_tensor_parallel
from tests.helpers import TINY, tiny_model


def plain_attend(layer, q, k, v):
    return attention(q, k, v)


@pytest.mark.parametrize("world", [2, 4])
def test_shards_sum_to_the_full_block(world):
    full = tiny_model()
    x = torch.randn(TINY.frame_tokens, TINY.dim, generator=torch.Generator().manual_seed(0))
    mod, _ = full.time_modulation(torch.tensor(0.5))
    expected = full.blocks[0](x, mod, lambda q, k, v: plain_attend(0, q, k, v))
    partials = []
    for rank in range(world):
        shard = apply_tensor_parallel(copy.deepcopy(full), rank, world, reduce=lambda y: partials.append(y) or torch.zeros_like(y))
        block = shard.blocks[0]
        assert isinstance(block, TensorParallelBlock)
        block(x, mod, lambda q, k, v: plain_attend(0, q, k, v))
        assert block.q_norm.weight.shape[0] == TINY.n_heads // world
    assert torch.allclose(x + sum(partials), expected, atol=1e-5)


def test_impossible_degree_is_refused():
    with pytest.raises(ValueError, match="tensor-parallel degree 3"):
        apply_tensor_parallel(tiny_model(), 0, 3)


def test_the_tensor_parallel_swap_keeps_the_shard_s_parameters_and_names():
    """The swapped block is built on the sharded block's own modules and parameters: no copies, the same names."""
    plain = apply_tensor_parallel(tiny_model(), 0, 2)
    params = {name: p for name, p in plain.named_parameters()}
    swapped = apply_tensor_parallel(tiny_model(), 0, 2, reduce=lambda y: y)
    assert [n for n, _ in swapped.named_parameters()] == list(params)
    block = plain.blocks[1]
    again = TensorParallelBlock(block, lambda y: y)
    assert dict(again.named_parameters()).keys() == dict(block.named_parameters()).keys()
    assert all(p is dict(block.named_parameters())[n] for n, p in again.named_parameters())
    assert again.qkv is block.qkv and again.modulation is block.modulation
