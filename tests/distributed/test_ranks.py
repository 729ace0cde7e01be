"""The rank mapping every component shares, and the parallel settings refused by name before anything starts."""
from __future__ import annotations

import pytest
import torch

from surge.config import ModelConfig, ParallelConfig
from surge.distributed.ranks import (global_rank, local_world_size, node_and_local_rank, node_leader_ranks,
                                     node_ranks)
from surge.model.models.llama import LlamaForCausalLM


def test_tp8_over_two_nodes():
    local = local_world_size(8, 2)
    assert local == 4
    assert list(node_ranks(0, local)) == [0, 1, 2, 3]
    assert list(node_ranks(1, local)) == [4, 5, 6, 7]
    assert [global_rank(1, i, local) for i in range(4)] == [4, 5, 6, 7]
    assert node_leader_ranks(2, local) == [0, 4]


def test_inverse_covers_every_rank_once():
    for world, nnodes in [(1, 1), (2, 1), (2, 2), (8, 2), (8, 4), (6, 3)]:
        local = local_world_size(world, nnodes)
        seen = []
        for node in range(nnodes):
            for i in range(local):
                rank = global_rank(node, i, local)
                assert node_and_local_rank(rank, local) == (node, i)
                seen.append(rank)
        assert sorted(seen) == list(range(world))


def test_bad_ranks_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide evenly across nnodes=2"):
        local_world_size(3, 2)
    with pytest.raises(ValueError, match="local_rank=4"):
        global_rank(1, 4, 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0 must be a positive integer"),
    (dict(nnodes=0), "nnodes=0 must be a positive integer"),
    (dict(tensor_parallel_size=3, nnodes=2, master_port=29500), "tensor_parallel_size=3 does not divide evenly"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=29500), r"node_rank=2 must be .* nnodes=2"),
    (dict(tensor_parallel_size=2, nnodes=2), "master_port is required when nnodes=2"),
    (dict(tensor_parallel_size=2, master_port=70000), "master_port=70000"),
    (dict(tensor_parallel_size=2, master_addr=""), "master_addr=''"),
])
def test_parallel_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def _model(heads: int, kv_heads: int, intermediate: int = 144) -> ModelConfig:
    cfg = dict(architectures=["LlamaForCausalLM"], hidden_size=heads * 16, num_hidden_layers=2,
               num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=100,
               intermediate_size=intermediate)
    return ModelConfig.from_hf_config("m", cfg, {}, "float32", torch.device("cpu"),
                                      supported_architectures=["LlamaForCausalLM"])


def check(parallel: ParallelConfig, model: ModelConfig) -> None:
    LlamaForCausalLM.check_parallel(model, parallel)


def test_model_must_split_over_ranks():
    # The default model (SmolLM2-135M) has 9 heads and 3 KV heads: tp=2 splits its KV heads 2 + 1.
    check(ParallelConfig(tensor_parallel_size=2), _model(9, 3))
    check(ParallelConfig(tensor_parallel_size=3), _model(9, 3))
    with pytest.raises(ValueError, match="num_key_value_heads=3"):  # 6 ranks cannot share 3 KV heads of 9 heads
        check(ParallelConfig(tensor_parallel_size=6), _model(9, 3))
    check(ParallelConfig(tensor_parallel_size=9), _model(9, 3))  # 3 ranks share each KV head
    check(ParallelConfig(tensor_parallel_size=4), _model(4, 1))
    with pytest.raises(ValueError, match="num_key_value_heads=4"):  # 6 ranks cannot share 4 KV heads evenly
        check(ParallelConfig(tensor_parallel_size=6), _model(12, 4, intermediate=120))
    with pytest.raises(ValueError, match="intermediate_size=130"):
        check(ParallelConfig(tensor_parallel_size=4), _model(4, 2, intermediate=130))


@pytest.mark.parametrize("heads, kv_heads, tp", [(9, 3, 2), (9, 3, 3), (8, 8, 3), (32, 8, 8), (16, 2, 8), (4, 1, 4),
                                                  (12, 4, 3), (10, 5, 4)])
def test_head_shards_tile_every_head_once(heads, kv_heads, tp):
    """Every query head lands on exactly one rank, next to the KV head of its group."""
    from surge.model.layers.linear import head_shard

    shards = [head_shard(heads, kv_heads, tp, r) for r in range(tp)]
    q_heads = [h for s in shards for h in range(s.q_start, s.q_start + s.q_count)]
    assert q_heads == list(range(heads))
    group = heads // kv_heads
    for s in shards:
        kv_of_q = {h // group for h in range(s.q_start, s.q_start + s.q_count)}
        assert kv_of_q <= set(range(s.kv_start, s.kv_start + s.kv_count))
    assert shards[0].kv_count == max(s.kv_count for s in shards)  # rank 0 sizes the KV cache
