"""Tensor-parallel layers against plain torch on the full weights, every rank simulated in one process: each rank
loads its shard through the weight loaders, and the sum (row-parallel, embedding) or the concatenation
(column-parallel) of the ranks' outputs must equal the unsplit layer. Collectives are replaced by the identity;
the real ones run in test_tensor_parallel.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from surge.distributed import parallel_state
from surge.distributed.parallel_state import TPGroup
from surge.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from surge.model.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from surge.model.layers.moe import SparseMoeBlock


@pytest.fixture
def as_rank(monkeypatch):
    monkeypatch.setattr(TPGroup, "all_reduce", lambda self, x: x)

    def set_rank(rank: int, world_size: int, expert_parallel: bool = False) -> None:
        group = TPGroup(rank=rank, world_size=world_size)
        monkeypatch.setattr(parallel_state, "_TP", group)
        monkeypatch.setattr(parallel_state, "_EP", group if expert_parallel else TPGroup())

    return set_rank


def _load(layer, **tensors):
    for shard_id, t in tensors.items():
        layer.weight.weight_loader(layer.weight, t, shard_id)


@pytest.mark.parametrize("tp, num_kv_heads", [(1, 2), (2, 2), (4, 2), (2, 1), (4, 1), (4, 4)])
def test_qkv_heads_and_their_kv_heads(as_rank, tp, num_kv_heads):
    torch.manual_seed(0)
    hidden, d, heads = 32, 8, 4
    wq = torch.randn(heads * d, hidden)
    wk, wv = torch.randn(num_kv_heads * d, hidden), torch.randn(num_kv_heads * d, hidden)
    x = torch.randn(5, hidden)
    q_full = (x @ wq.T).view(5, heads, d)
    k_full, v_full = (x @ wk.T).view(5, num_kv_heads, d), (x @ wv.T).view(5, num_kv_heads, d)
    group = heads // num_kv_heads  # query heads per KV head
    for rank in range(tp):
        as_rank(rank, tp)
        layer = QKVParallelLinear(hidden, d, heads, num_kv_heads)
        _load(layer, q=wq, k=wk, v=wv)
        assert layer.num_kv_heads == max(1, num_kv_heads // tp)
        q, k, v = layer(x).split([layer.num_heads * d, layer.num_kv_heads * d, layer.num_kv_heads * d], dim=-1)
        q, k, v = q.view(5, -1, d), k.view(5, -1, d), v.view(5, -1, d)
        local_group = layer.num_heads // layer.num_kv_heads
        for j in range(layer.num_heads):
            h = rank * layer.num_heads + j  # the global query head
            torch.testing.assert_close(q[:, j], q_full[:, h])
            # Attention pairs local query head j with local KV head j // local_group: it must be head h's KV head.
            torch.testing.assert_close(k[:, j // local_group], k_full[:, h // group])
            torch.testing.assert_close(v[:, j // local_group], v_full[:, h // group])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_then_down(as_rank, tp):
    torch.manual_seed(1)
    hidden, inter = 16, 24
    gate, up, down, bias = (torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter),
                            torch.randn(hidden))
    x = torch.randn(3, hidden)
    expected = F.linear(F.silu(x @ gate.T) * (x @ up.T), down, bias)
    total = torch.zeros_like(expected)
    for rank in range(tp):
        as_rank(rank, tp)
        gate_up = MergedColumnParallelLinear(hidden, {0: inter, 1: inter})
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        down_proj = RowParallelLinear(inter, hidden, bias=True)
        down_proj.weight.weight_loader(down_proj.weight, down)
        down_proj.bias.weight_loader(down_proj.bias, bias)
        g, u = gate_up(x).chunk(2, dim=-1)
        total += down_proj(F.silu(g) * u)  # the all-reduce, by hand
    torch.testing.assert_close(total, expected)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_then_row(as_rank, tp):
    torch.manual_seed(3)
    w1, b1, w2 = torch.randn(8, 12), torch.randn(8), torch.randn(12, 8)
    x = torch.randn(2, 12)
    total = torch.zeros(2, 12)
    for rank in range(tp):
        as_rank(rank, tp)
        col, row = ColumnParallelLinear(12, 8, bias=True), RowParallelLinear(8, 12)
        col.weight.weight_loader(col.weight, w1)
        col.bias.weight_loader(col.bias, b1)
        row.weight.weight_loader(row.weight, w2)
        total += row(col(x))
    torch.testing.assert_close(total, F.linear(F.linear(x, w1, b1), w2))


@pytest.mark.parametrize("tp, ep", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_experts_split_by_intermediate_or_by_expert(as_rank, tp, ep):
    """Each rank loads per-expert tensors through the weight loader: a slice of every expert without expert
    parallelism, E / tp whole experts with it; the ranks' partial outputs sum to the plain per-token computation."""
    torch.manual_seed(4)
    num_experts, top_k, hidden, inter = 8, 3, 16, 12
    router = torch.randn(num_experts, hidden)
    gate, up = torch.randn(num_experts, inter, hidden), torch.randn(num_experts, inter, hidden)
    down = torch.randn(num_experts, hidden, inter)
    x = torch.randn(9, hidden)
    probs = torch.softmax(x @ router.T, dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    expected = torch.stack([sum(w * (down[e] @ (F.silu(gate[e] @ row) * (up[e] @ row)))
                                for w, e in zip(weights[t], ids[t].tolist())) for t, row in enumerate(x)])
    total = torch.zeros_like(expected)
    for rank in range(tp):
        as_rank(rank, tp, ep)
        block = SparseMoeBlock(hidden, num_experts, top_k, inter, norm_topk_prob=True)
        block.gate.weight.weight_loader(block.gate.weight, router)
        experts = block.experts
        for e in range(num_experts):
            for proj, w in (("gate", gate[e]), ("up", up[e]), ("down", down[e])):
                param = experts.down_proj if proj == "down" else experts.gate_up_proj
                param.weight_loader(param, w, (proj, e))
        if ep:
            assert experts.gate_up_proj.shape == (num_experts // tp, 2 * inter, hidden)
            assert torch.equal(experts.down_proj[0], down[rank * num_experts // tp])
        else:
            assert experts.gate_up_proj.shape == (num_experts, 2 * inter // tp, hidden)
        total += block(x)  # the all-reduce, by hand
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_vocab_split_with_padding(as_rank, tp):
    torch.manual_seed(2)
    vocab, hidden = 10, 6  # 10 rows over 3 or 4 ranks: the last rank's tail is padding
    w = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 3, 9, 5, 9, 1])
    total = torch.zeros(len(ids), hidden)
    head_rows = []
    for rank in range(tp):
        as_rank(rank, tp)
        emb, head = VocabParallelEmbedding(vocab, hidden), ParallelLMHead(vocab, hidden)
        emb.weight.weight_loader(emb.weight, w)
        head.weight.weight_loader(head.weight, w)
        total += emb(ids)
        head_rows.append(head.weight.data)
    torch.testing.assert_close(total, F.embedding(ids, w))
    full = torch.cat(head_rows)
    assert torch.equal(full[:vocab], w) and not full[vocab:].any()


def test_shapes_that_do_not_split_are_refused(as_rank):
    as_rank(0, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 exceeds num_key_value_heads=3"):
        QKVParallelLinear(16, 4, 3, 3)
    as_rank(1, 2)  # 3 KV heads over 2 ranks: 2 + 1, each with its query heads
    qkv = QKVParallelLinear(16, 4, 3, 3)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.weight.shape[0]) == (1, 1, 3 * 4)
    as_rank(0, 2)
    layer = RowParallelLinear(8, 4)
    with pytest.raises(ValueError, match=r"does not fit parameter of shape \(4, 4\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(4, 6))
