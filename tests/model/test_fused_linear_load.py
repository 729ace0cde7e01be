"""A fused checkpoint tensor (Phi-3's qkv_proj and gate_up_proj: every projection stacked) loads under tensor
parallelism exactly as its separately stored parts do: each rank keeps its slice of each projection."""
from __future__ import annotations

import pytest
import torch

from surge.config import ParallelConfig
from surge.distributed.parallel_state import layout_of_rank
from surge.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER = 64, 16, 4, 2, 96


def _build(tp: int, rank: int, make):
    with layout_of_rank(ParallelConfig(tensor_parallel_size=tp), rank):
        return make()


@pytest.mark.parametrize("tp", [2, 4])  # 4 > KV heads: each KV head replicated on two ranks
def test_fused_qkv_loads_as_its_q_k_v_parts(tp):
    g = torch.Generator().manual_seed(tp)
    q, k, v = (torch.randn(n * HEAD_DIM, HIDDEN, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS))
    qb, kb, vb = (torch.randn(t.shape[0], generator=g) for t in (q, k, v))
    for rank in range(tp):
        def make():
            return QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True)
        fused, split = _build(tp, rank, make), _build(tp, rank, make)
        fused.weight.weight_loader(fused.weight, torch.cat([q, k, v]), None)
        fused.bias.weight_loader(fused.bias, torch.cat([qb, kb, vb]), None)
        for shard_id, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            split.weight.weight_loader(split.weight, w, shard_id)
            split.bias.weight_loader(split.bias, b, shard_id)
        assert torch.equal(fused.weight, split.weight) and torch.equal(fused.bias, split.bias)
        # and that is this rank's heads: its query heads, then the KV heads they read
        sh, d = fused.shard, HEAD_DIM
        expected = torch.cat([q[sh.q_start * d:(sh.q_start + sh.q_count) * d],
                              k[sh.kv_start * d:(sh.kv_start + sh.kv_count) * d],
                              v[sh.kv_start * d:(sh.kv_start + sh.kv_count) * d]])
        assert torch.equal(fused.weight, expected)


def test_fused_gate_up_loads_as_its_parts():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(INTER, HIDDEN, generator=g), torch.randn(INTER, HIDDEN, generator=g)
    for rank in range(2):
        def make():
            return MergedColumnParallelLinear(HIDDEN, {0: INTER, 1: INTER})
        fused, split = _build(2, rank, make), _build(2, rank, make)
        fused.weight.weight_loader(fused.weight, torch.cat([gate, up]), None)
        split.weight.weight_loader(split.weight, gate, 0)
        split.weight.weight_loader(split.weight, up, 1)
        half = INTER // 2
        rows = slice(rank * half, (rank + 1) * half)
        assert torch.equal(fused.weight, split.weight)
        assert torch.equal(fused.weight, torch.cat([gate[rows], up[rows]]))


def test_fused_tensor_of_the_wrong_size_is_refused():
    layer = _build(2, 0, lambda: MergedColumnParallelLinear(HIDDEN, {0: INTER, 1: INTER}))
    with pytest.raises(ValueError, match="does not stack the shards"):
        layer.weight.weight_loader(layer.weight, torch.randn(INTER, HIDDEN), None)
