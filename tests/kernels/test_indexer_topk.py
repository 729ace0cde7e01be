"""The indexer's top-k kernel against the CPU total-order reference (a stable sort): NaN, +-inf, -0.0 vs +0.0 and
ties, row lengths at k/k+1 (128/129), at the chunk (split) boundary and at the capacity; its launch policy at its
N/N+1 boundaries; CUDA graph replays that leave nothing behind."""
from __future__ import annotations

import pytest
import torch

from surge.kernels import indexer_topk as topk_mod
from surge.kernels.deepseek_v4_reference import indexer_topk as reference
from surge.kernels.deepseek_v4_reference import total_order_key
from surge.kernels.indexer_topk import IndexerTopK, launch_policy, split_launch, workspace_shape


def _special_scores(rows: int, width: int, seed: int) -> torch.Tensor:
    """Random scores drawn from few values (many ties) laced with NaN, +-inf and both zeros."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 0.5, 3.0, -2.5, 1e-30,
                         -1e-30, 3.4e38, -3.4e38])
    x = torch.randn(rows, width, generator=g)
    special = torch.rand(rows, width, generator=g) < 0.5
    return torch.where(special, pool[torch.randint(len(pool), (rows, width), generator=g)], x)


def _run(scores, lengths, k, launch=None, device=torch.device("cpu")):
    kernel = IndexerTopK(device)
    return kernel(scores.to(device), lengths.to(device=device, dtype=torch.int32), k, launch=launch).cpu()


# ---- the reference itself ----

def test_total_order_key_orders_specials():
    values = torch.tensor([float("-inf"), -3.4e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3.4e38, float("inf"),
                           float("nan")])
    keys = total_order_key(values)
    assert torch.all(keys[1:] >= keys[:-1])
    assert keys[4] == keys[5]  # -0.0 == +0.0
    assert len(set(keys.tolist())) == len(values) - 1


def test_reference_ties_go_to_the_lower_index():
    scores = torch.tensor([[1.0, 2.0, 2.0, -0.0, 0.0, 2.0, float("nan")]])
    assert reference(scores, torch.tensor([7]), 3).tolist() == [[1, 2, 6]]
    assert reference(scores, torch.tensor([6]), 4).tolist() == [[0, 1, 2, 5]]
    assert reference(scores, torch.tensor([6]), 5).tolist() == [[0, 1, 2, 3, 5]]  # -0.0 at 3 before +0.0 at 4
    assert reference(scores, torch.tensor([2]), 4).tolist() == [[0, 1, -1, -1]]


# ---- launch policy ----

def test_policy_short_and_split_boundary():
    short = launch_policy(topk_mod.SHORT_MAX, 512)
    assert not short.split and short.block == topk_mod.SHORT_MAX and short.num_chunks == 1
    split = launch_policy(topk_mod.SHORT_MAX + 1, 512)
    assert split.split and split.num_chunks == 2 and split.block == topk_mod.CHUNK
    assert split.merge_block == 1024
    assert launch_policy(129, 128).block == 256 and launch_policy(128, 128).block == 128


def test_policy_grows_the_chunk_until_the_merge_fits():
    k = 512
    fits = topk_mod.MERGE_MAX // k * topk_mod.CHUNK  # 16 chunks of 4096
    assert launch_policy(fits, k).block == topk_mod.CHUNK
    assert launch_policy(fits + 1, k).block == 2 * topk_mod.CHUNK
    limit = topk_mod.MERGE_MAX // k * topk_mod.MAX_CHUNK
    launch = launch_policy(limit, k)
    assert launch.block == topk_mod.MAX_CHUNK and launch.merge_block == topk_mod.MERGE_MAX
    with pytest.raises(ValueError, match="beyond the split top-k"):
        launch_policy(limit + 1, k)


def test_policy_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k=0"):
        launch_policy(100, 0)
    with pytest.raises(ValueError, match="max_len=0"):
        launch_policy(0, 4)
    with pytest.raises(ValueError, match="radix_bits=3"):
        launch_policy(100, 4, radix_bits=3)
    with pytest.raises(ValueError, match="chunk=100"):
        split_launch(1000, 4, 100)


def test_call_rejects_bad_arguments():
    kernel = IndexerTopK(torch.device("cpu"))
    with pytest.raises(ValueError, match="lengths must be int32"):
        kernel(torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="scores must be"):
        kernel(torch.zeros(8, 2).t(), torch.zeros(2, dtype=torch.int32), 4)


# ---- exact against the reference (Triton's interpreter on the CPU) ----

@pytest.mark.parametrize("lengths", [[127, 128, 129, 200, 256, 0, 1, 300]])  # 300 > capacity: clamped
def test_short_rows_at_the_k_boundary(lengths, device):
    k, width = 128, 256
    scores = _special_scores(len(lengths), width, seed=0)
    lengths = torch.tensor(lengths)
    launch = launch_policy(width, k)
    assert not launch.split
    assert torch.equal(_run(scores, lengths, k, device=device), reference(scores, lengths, k))


@pytest.mark.parametrize("radix_bits", [1, 4, 8])
def test_radix_width_never_changes_the_result(radix_bits, device):
    k, width = 16, 64
    scores = _special_scores(4, width, seed=radix_bits)
    lengths = torch.tensor([64, 17, 16, 5])
    launch = launch_policy(width, k, radix_bits=radix_bits)
    assert torch.equal(_run(scores, lengths, k, launch, device), reference(scores, lengths, k))


@pytest.mark.parametrize("k", [16, 128])
def test_split_rows_at_the_chunk_boundary(k, device):
    """Chunks of 128: rows of 128 (one chunk) and 129 (two), 256/257 (two/three), k and k + 1, and the capacity."""
    chunk, width = 128, 384
    lengths = torch.tensor([128, 129, 256, 257, k, k + 1, 384, 0, 3])
    scores = _special_scores(len(lengths), width, seed=k)
    launch = split_launch(width, k, chunk)
    assert launch.split and launch.num_chunks == 3
    assert torch.equal(_run(scores, lengths, k, launch, device), reference(scores, lengths, k))


def test_split_equals_short_on_all_equal_scores(device):
    """Every score tied: the lowest indices win, across chunks too."""
    k, width = 16, 256
    scores = torch.full((3, width), -0.0)
    scores[1, ::2] = 0.0
    scores[2] = float("nan")
    lengths = torch.tensor([256, 100, 129])
    expected = reference(scores, lengths, k)
    assert expected[0].tolist() == list(range(16))
    assert torch.equal(_run(scores, lengths, k, split_launch(width, k, 64), device), expected)
    assert torch.equal(_run(scores, lengths, k, launch_policy(width, k), device), expected)


def test_bf16_scores(device):
    k, width = 8, 64
    scores = torch.randn(3, width).to(torch.bfloat16)  # coarse: many ties
    lengths = torch.tensor([64, 40, 9])
    assert torch.equal(_run(scores, lengths, k, device=device), reference(scores, lengths, k))


def test_workspace_shape():
    key = IndexerTopK(torch.device("cpu")).dispatch(max_len=topk_mod.SHORT_MAX + 1, k=64)
    assert workspace_shape(3, key) == (2, 3, 2 * 64)
    assert workspace_shape(3, IndexerTopK(torch.device("cpu")).dispatch(max_len=100, k=64)) == (0,)


# ---- CUDA graphs (the H200 runs these: scripts/h200 v4-kernel-tests) ----

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("split", [False, True])
def test_cuda_graph_replays_leave_nothing_behind(split):
    """Captured once; each replay with new scores and shorter or longer rows, the scratch poisoned in between,
    equals the reference: the kernels keep no counters and rewrite every scratch slot before reading it."""
    device = torch.device("cuda")
    k, width, rows = 64, 8192 if split else 2048, 8
    kernel = IndexerTopK(device)
    key = kernel.dispatch(max_len=width, k=k)
    assert key.launch.split == split
    scores = torch.empty(rows, width, device=device)
    lengths = torch.empty(rows, dtype=torch.int32, device=device)
    workspace = torch.empty(workspace_shape(rows, key), dtype=torch.int32, device=device)
    out = torch.empty(rows, k, dtype=torch.int32, device=device)
    scores.copy_(_special_scores(rows, width, seed=100))
    lengths.fill_(width)
    kernel(scores, lengths, k, out=out, workspace=workspace)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(scores, lengths, k, out=out, workspace=workspace)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        new_scores = _special_scores(rows, width, seed=200 + step)
        new_lengths = torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32)
        new_lengths[0] = width if step % 2 else 1
        scores.copy_(new_scores)
        lengths.copy_(new_lengths)
        workspace.fill_(-7)  # stale candidates would show
        out.fill_(123)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), reference(new_scores, new_lengths, k)), step
