"""Fused MoE kernel: equals the torch reference (surge/kernels/reference.py, HF's experts loop) on random shapes, for
every launch geometry, with experts that receive no tokens, a single token, and experts held by another rank; the
block alignment against a plain Python model; the launch policy at its N/N+1 boundaries; CUDA graph replay."""
from __future__ import annotations

import pytest
import torch

from surge.kernels.reference import fused_moe as reference


def _case(num_tokens, num_experts, top_k, hidden, inter, dtype, device, seed=0, remote=0):
    """Random experts and routing; `remote` experts (the highest ids) are another rank's, so their ids become -1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    scores = torch.rand(num_tokens, num_experts + remote, generator=g)
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    ids = torch.where(ids < num_experts, ids, -1)
    return [t.to(device=device, dtype=dtype) for t in (x, gate_up, down, weights)] + [ids.to(device)]


def _check(got, expected, dtype):
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)


def _launches(num_tokens, num_experts, top_k, hidden, inter):
    from surge.kernels.fused_moe import GemmTiles, MoeLaunch, launch_policy

    chosen = launch_policy(num_tokens, top_k, num_experts, hidden, inter)
    return [chosen, MoeLaunch(16, GemmTiles(16, 16, 4, 2), GemmTiles(32, 16, 4, 2)),
            MoeLaunch(32, GemmTiles(32, 64, 4, 2), GemmTiles(16, 32, 4, 2)),
            MoeLaunch(64, GemmTiles(64, 32, 4, 2), GemmTiles(64, 64, 4, 2))]


# (tokens, experts, top_k, hidden, intermediate): one token; more experts than pairs (most get none); shapes that
# are not multiples of any tile; many tokens per expert.
SHAPES = [(1, 8, 2, 64, 32), (3, 16, 2, 48, 40), (37, 8, 3, 96, 56), (130, 4, 2, 32, 24)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-E{s[1]}-k{s[2]}-H{s[3]}-I{s[4]}" for s in SHAPES])
def test_equals_reference_for_every_geometry(shape, device):
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(*shape, torch.float32, device)
    expected = reference(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu())
    if shape[0] * shape[2] < shape[1]:
        assert len(ids.unique()) < shape[1]  # some experts receive no token
    for launch in _launches(*shape):
        _check(fused_moe(x, gate_up, down, weights, ids, launch=launch).cpu(), expected, torch.float32)


def test_experts_held_elsewhere_contribute_nothing(device):
    """Expert parallelism: ids of -1; a token whose experts are all remote gets zeros."""
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(29, 4, 3, 64, 32, torch.float32, device, seed=3, remote=4)
    ids[0] = -1
    assert (ids == -1).any(dim=1).sum() > 5
    expected = reference(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu())
    got = fused_moe(x, gate_up, down, weights, ids).cpu()
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    _check(got, expected, torch.float32)


def test_bf16_equals_reference(device, require_bf16_dot):
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(21, 8, 2, 64, 48, torch.bfloat16, device, seed=5)
    # The reference in float32 from the same bf16 inputs: the kernel accumulates in float32 and rounds once.
    expected = reference(x.cpu().float(), gate_up.cpu().float(), down.cpu().float(), weights.cpu().float(),
                         ids.cpu())
    got = fused_moe(x, gate_up, down, weights, ids)
    assert got.dtype == torch.bfloat16
    _check(got.cpu(), expected, torch.bfloat16)


@pytest.mark.parametrize("block_m", [16, 32])
def test_alignment_against_a_plain_model(block_m, device):
    from surge.kernels.fused_moe import align_to_blocks, max_padded_pairs

    g = torch.Generator().manual_seed(block_m)
    num_experts, ids = 6, torch.randint(-1, 5, (23, 3), generator=g)  # expert 5 gets nothing, -1 is remote
    sorted_ids, block_expert = align_to_blocks(ids.to(device), num_experts, block_m)
    sorted_ids, block_expert = sorted_ids.cpu().tolist(), block_expert.cpu().tolist()
    flat, num_pairs = ids.flatten().tolist(), ids.numel()
    expected_ids, expected_blocks = [], []
    for e in range(num_experts):  # each expert's pairs in order, padded to whole blocks
        pairs = [p for p, pe in enumerate(flat) if pe == e]
        blocks = -(-len(pairs) // block_m)
        expected_ids += pairs + [num_pairs] * (blocks * block_m - len(pairs))
        expected_blocks += [e] * blocks
    rows = max_padded_pairs(num_pairs, num_experts, block_m)
    expected_ids += [num_pairs] * (rows - len(expected_ids))
    expected_blocks += [-1] * (rows // block_m - len(expected_blocks))
    assert sorted_ids == expected_ids and block_expert == expected_blocks


def test_launch_policy_boundaries():
    from surge.kernels.fused_moe import MAX_BLOCK_M, launch_policy

    def block_m(tokens):  # 8 experts, top 2: tokens / 4 pairs per expert
        return launch_policy(tokens, 2, 8, 2048, 768).block_m

    assert block_m(1) == 16 and block_m(64) == 16 and block_m(65) == 32
    assert block_m(128) == 32 and block_m(129) == 64
    assert block_m(256) == 64 and block_m(257) == MAX_BLOCK_M == 64 and block_m(1 << 16) == 64
    decode, prefill = launch_policy(128, 2, 8, 2048, 768), launch_policy(129, 2, 8, 2048, 768)
    assert (decode.gate_up.block_n, decode.gate_up.block_k, decode.gate_up.num_stages) == (64, 128, 4)
    assert (prefill.gate_up.block_n, prefill.gate_up.block_k, prefill.gate_up.num_stages) == (128, 64, 3)
    # Qwen3-30B-A3B (128 experts, 8 per token): batch 1 decode and a 2048-token prefill.
    assert launch_policy(1, 8, 128, 2048, 768).block_m == 16 and launch_policy(2048, 8, 128, 2048, 768).block_m == 64
    tiny = launch_policy(1, 1, 1, 24, 8)  # tiles never exceed the (padded) dimension, nor go below 16
    assert (tiny.gate_up.block_n, tiny.gate_up.block_k, tiny.down.block_n, tiny.down.block_k) == (16, 32, 32, 16)
    for bad in [dict(num_tokens=0), dict(top_k=9), dict(hidden=0)]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            launch_policy(**{**dict(num_tokens=4, top_k=2, num_experts=8, hidden=64, intermediate=32), **bad})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_replays_any_routing():
    from surge.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(16, 8, 2, 64, 32, torch.bfloat16, torch.device("cuda"))
    fused_moe(x, gate_up, down, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, gate_up, down, weights, ids)
    for seed in (1, 2):
        nx, _, _, nw, nids = _case(16, 8, 2, 64, 32, torch.bfloat16, torch.device("cuda"), seed=seed)
        x.copy_(nx), weights.copy_(nw), ids.copy_(nids)
        graph.replay()
        expected = fused_moe(x, gate_up, down, weights, ids)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
