"""The indexer's scoring kernel: its torch reference against HF's DeepseekV4IndexerScorer, the kernel against the
reference over a shuffled paged key cache (row lengths at the tile and cache-block N/N+1 boundaries, rows sharing a
sequence through row_seq), and its launch policy at its boundaries."""
from __future__ import annotations

import pytest
import torch

from surge.kernels.deepseek_v4_reference import indexer_scores as reference
from surge.kernels.indexer_score import IndexerScores, launch_policy


def _paged(keys_per_seq: list[torch.Tensor], block_size: int, seed: int):
    """Each sequence's keys [S_i, D] in shuffled cache blocks: (cache, block_table)."""
    g = torch.Generator().manual_seed(seed)
    dim = keys_per_seq[0].shape[1]
    blocks = [-(-k.shape[0] // block_size) for k in keys_per_seq]
    total = sum(blocks) + 2
    order = torch.randperm(total, generator=g)
    cache = torch.randn(total, block_size, dim, generator=g).to(keys_per_seq[0].dtype)  # garbage where unused
    table = torch.zeros(len(keys_per_seq), max(blocks), dtype=torch.int32)
    used = 0
    for i, k in enumerate(keys_per_seq):
        for b in range(blocks[i]):
            part = k[b * block_size:(b + 1) * block_size]
            cache[order[used], :part.shape[0]] = part
            table[i, b] = order[used]
            used += 1
    return cache, table


def test_reference_matches_hf_scorer():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

    config = DeepseekV4Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              head_dim=32, q_lora_rank=16, index_n_heads=3, index_head_dim=16, index_topk=4,
                              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, o_groups=1,
                              o_lora_rank=8)
    torch.manual_seed(0)
    scorer = DeepseekV4IndexerScorer(config)
    q, keys, hidden = torch.randn(1, 5, 3, 16), torch.randn(1, 7, 16), torch.randn(1, 5, 32)
    expected = scorer(q, keys, hidden)[0]
    weights = scorer.weights_proj(hidden)[0]
    got = reference(q[0], weights, keys[0], scorer.softmax_scale, scorer.weights_scaling)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_policy_boundaries():
    assert launch_policy(1, 1) == launch_policy(16, 16)  # tl.dot's minimum tile
    assert launch_policy(17, 16).heads_pad == 32
    assert launch_policy(33, 128).block_n == 64 and launch_policy(64, 65).block_n == 64  # an 8192-element q tile
    assert launch_policy(32, 128).block_n == 128 and launch_policy(64, 64).block_n == 128
    assert launch_policy(64, 128).num_warps == 8
    for bad in ((0, 16), (129, 16), (4, 0), (4, 513)):
        with pytest.raises(ValueError):
            launch_policy(*bad)


def _check(dtype, num_heads, head_dim, lengths, seqs_of_rows, block_size, max_len, device, rtol, atol, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [max(n for n, s in zip(lengths, seqs_of_rows) if s == seq) for seq in range(max(seqs_of_rows) + 1)]
    keys = [torch.randn(n, head_dim, generator=g).to(dtype) for n in seq_lens]
    cache, table = _paged(keys, block_size, seed)
    rows = len(lengths)
    q = torch.randn(rows, num_heads, head_dim, generator=g).to(dtype)
    weights = torch.randn(rows, num_heads, generator=g).to(dtype)
    row_seq = torch.tensor(seqs_of_rows, dtype=torch.int32)
    one_to_one = seqs_of_rows == list(range(rows))
    kernel = IndexerScores(device)
    out = kernel(q.to(device), weights.to(device), cache.to(device), table.to(device),
                 torch.tensor(lengths, dtype=torch.int32, device=device), max_len=max_len, softmax_scale=0.25,
                 weights_scale=num_heads ** -0.5, row_seq=None if one_to_one else row_seq.to(device)).cpu()
    for r, n in enumerate(lengths):
        n = min(n, max_len)
        expected = reference(q[r:r + 1], weights[r:r + 1], keys[seqs_of_rows[r]][:n], 0.25, num_heads ** -0.5)[0]
        torch.testing.assert_close(out[r, :n], expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("lengths", [[127, 128, 129, 1, 0, 256]])
def test_decode_rows_fp32(lengths, device):
    """One row per sequence; lengths at the 128-entry tile boundary (H=3, D=16: tiles of 128) and cache blocks
    of 16."""
    assert launch_policy(3, 16).block_n == 128
    _check(torch.float32, 3, 16, lengths, list(range(len(lengths))), 16, 256, device, 1e-5, 1e-5)


def test_prefill_rows_share_a_sequence(device):
    """Rows of one sequence see growing prefixes of its keys (the causal lengths); cache blocks of 4 at 4/5."""
    lengths = [4, 5, 8, 9, 3, 64]
    _check(torch.float32, 5, 24, lengths, [0, 0, 0, 0, 1, 1], 4, 64, device, 1e-5, 1e-5, seed=1)


def test_bf16(device, require_bf16_dot):
    _check(torch.bfloat16, 4, 32, [33, 64, 65], [0, 1, 2], 8, 96, device, 1e-5, 1e-5, seed=2)


def test_rejects_bad_arguments(device):
    kernel = IndexerScores(device)
    q, w = torch.zeros(2, 3, 16), torch.zeros(2, 3)
    cache, table = torch.zeros(4, 8, 16), torch.zeros(2, 1, dtype=torch.int32)
    lengths = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="key_cache must be"):
        kernel(q, w, cache.to(torch.bfloat16), table, lengths, max_len=8, softmax_scale=1.0, weights_scale=1.0)
    with pytest.raises(ValueError, match="weights must be"):
        kernel(q, w[:, :2], cache, table, lengths, max_len=8, softmax_scale=1.0, weights_scale=1.0)
    with pytest.raises(ValueError, match="lengths must be int32"):
        kernel(q, w, cache, table, lengths.long(), max_len=8, softmax_scale=1.0, weights_scale=1.0)
