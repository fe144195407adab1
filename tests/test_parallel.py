"""Tensor-parallel sharding: the shards' partial block outputs sum to the full block's."""

import copy

import pytest
import torch

from engine.cache import attention
from engine.parallel import shard_model_
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
        shard = shard_model_(copy.deepcopy(full), rank, world)
        block = shard.blocks[0]
        block.reduce = lambda y: partials.append(y) or torch.zeros_like(y)
        block(x, mod, lambda q, k, v: plain_attend(0, q, k, v))
        assert block.q_norm.weight.shape[0] == TINY.n_heads // world
    assert torch.allclose(x + sum(partials), expected, atol=1e-5)


def test_impossible_degree_is_refused():
    with pytest.raises(ValueError, match="tensor-parallel degree 3"):
        shard_model_(tiny_model(), 0, 3)
