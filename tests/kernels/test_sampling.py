"""Triton greedy/top-k/top-p sampling: exactly the total-order reference (special values, ties, every launch
geometry), the Sampler's semantics on ordinary logits, the launch policy's boundaries, and CUDA graph replays."""
from __future__ import annotations

import pytest
import torch

from surge.model.layers.sampler import _apply_top_k_top_p

V = 200


def _special_batch(device):
    """Rows that stress the ordering: NaN, +-inf, +-0, heavy ties, all -inf, and ordinary rows."""
    gen = torch.Generator().manual_seed(0)
    rows = [(torch.randn(V, generator=gen) * 3) for _ in range(14)]
    rows[0][[5, 9]] = float("nan")  # NaN ranks highest: sampled among the NaNs
    rows[1][:] = float("-inf")  # nothing finite: uniform over the -infs
    rows[2][[7, 150]] = float("inf")
    rows[2][[3]] = float("-inf")
    rows[3] = torch.randint(0, 3, (V,), generator=gen).float()  # ties across the top-k and top-p cuts
    rows[4] = torch.where(torch.arange(V) % 2 == 0, torch.tensor(-0.0), torch.tensor(0.0))  # +0 == -0
    rows[5][[11, 12, 13]] = rows[5].max() + 1  # tied maximum: greedy takes index 11
    rows[6][[40, 41]] = float("nan")
    rows[6][[0]] = float("inf")
    logits = torch.stack(rows)
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 1.3, 1.0, 1.0, 2.0, 0.9, 1.0])
    top_k = torch.tensor([0, 5, 1, 3, 10, 0, 0, 20, V, V - 1, 1, 50, -1, 7], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.7, 1.0, 1.0, 0.8, 0.95, 0.1, 1.0, 1e-9, 0.6, 0.99])
    noise = torch.empty(len(rows), V).exponential_(generator=gen).clamp_min_(torch.finfo(torch.float32).tiny)
    return tuple(t.to(device) for t in (logits, temperature, top_k, top_p, noise))


def _sampler(device):
    from surge.kernels.sampling import TopKTopPSampler

    return TopKTopPSampler(device)


def _launches():
    from surge.kernels.sampling import SamplingLaunch, launch_policy

    single = launch_policy(16, V, V)
    assert single.single_tile
    return [single,
            SamplingLaunch(128, 2, False, 2, 4, 2, single.weight_bits, True),  # chunked; candidates always fit
            SamplingLaunch(64, 4, False, 1, 4, 2, single.weight_bits, True),  # crowded lanes overflow to the row
            SamplingLaunch(64, 4, False, 0, 4, 2, single.weight_bits, True)]  # every search visits the row


def test_kernel_equals_reference_exactly_for_every_geometry(device):
    from surge.kernels.sampling import sample_reference

    logits, temperature, top_k, top_p, noise = _special_batch(device)
    sampler = _sampler(device)
    expected = sample_reference(logits, temperature, top_k, top_p, noise, _launches()[0].weight_bits)
    assert expected[5] == 11 and expected[6] in (40, 41) and expected[0] in (5, 9) and expected[2] in (7, 150)
    for launch in _launches():
        got = sampler(logits, temperature, top_k, top_p, noise, max_batch=16, max_k=V, launch=launch)
        assert got.tolist() == expected.tolist(), launch


def test_top_p_cut_inside_ties_keeps_the_lower_indices(device):
    """V equal logits: top-p keeps exactly the first ceil(p * V) of them, in index order, across chunk borders.
    Noise 1 / (i + 1) makes the highest surviving index win the race, so the cut shows in the token."""
    from surge.kernels.sampling import sample_reference

    top_p = torch.tensor([0.25, 0.7, 0.999, 1.0], device=device)  # 0.7 is 0.69999999 in float32
    n = len(top_p)
    logits = torch.zeros(n, V, device=device)
    noise = (1.0 / torch.arange(1, V + 1, dtype=torch.float32, device=device)).expand(n, V).contiguous()
    temperature = torch.ones(n, device=device)
    top_k = torch.zeros(n, dtype=torch.int32, device=device)
    expected = [49, 139, V - 1, V - 1]
    assert sample_reference(logits, temperature, top_k, top_p, noise, 20).tolist() == expected
    for launch in _launches():
        got = _sampler(device)(logits, temperature, top_k, top_p, noise, max_batch=n, max_k=V, launch=launch)
        assert got.tolist() == expected, launch


def test_top_p_bar_met_exactly_drops_the_element(device):
    """256 equal logits and p = 255/256: the last element's mass before equals the bar exactly, so it drops."""
    from surge.kernels.sampling import SamplingLaunch, launch_policy

    vocab = 256
    args = (torch.zeros(1, vocab, device=device), torch.ones(1, device=device),
            torch.zeros(1, dtype=torch.int32, device=device), torch.tensor([255 / 256], device=device),
            (1.0 / torch.arange(1, vocab + 1, dtype=torch.float32, device=device))[None].contiguous())
    for launch in [launch_policy(1, vocab, 0), SamplingLaunch(64, 4, False, 4, 4, 2, 20, False)]:
        assert _sampler(device)(*args, max_batch=1, max_k=0, launch=launch).tolist() == [254]


def test_greedy_is_torch_argmax_on_raw_logits(device):
    logits, _, top_k, top_p, noise = _special_batch(device)
    temperature = torch.zeros(logits.shape[0], device=device)
    got = _sampler(device)(logits, temperature, top_k, top_p, noise, max_batch=16, max_k=V)
    assert got.tolist() == logits.cpu().argmax(dim=-1).tolist()  # NaN first, then ties to the lower index


def test_bf16_logits_and_chunked_vocab_not_a_power_of_two(device):
    from surge.kernels.sampling import SamplingLaunch, sample_reference

    gen = torch.Generator().manual_seed(5)
    vocab = 333
    logits = (torch.randn(4, vocab, generator=gen) * 4).to(torch.bfloat16).to(device)  # bf16 rounding: ties
    temperature = torch.tensor([0.0, 1.0, 0.8, 1.0], device=device)
    top_k = torch.tensor([0, 40, 0, 3], dtype=torch.int32, device=device)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0], device=device)
    noise = torch.empty(4, vocab).exponential_(generator=gen).to(device)
    launch = SamplingLaunch(128, 3, False, 2, 4, 2, 20, True)
    got = _sampler(device)(logits, temperature, top_k, top_p, noise, max_batch=4, max_k=vocab, launch=launch)
    assert got.tolist() == sample_reference(logits, temperature, top_k, top_p, noise, 20).tolist()


def test_matches_the_samplers_semantics_on_ordinary_logits(device):
    """Without ties or special values, the kernel draws what Sampler draws from the same noise: temperature, then
    top-k, then top-p on the survivors, then argmax(probs / q)."""
    gen = torch.Generator().manual_seed(3)
    n = 16
    logits = torch.randn(n, V, generator=gen) * 2
    temperature = torch.rand(n, generator=gen) + 0.3
    top_k = torch.tensor([0, 1, 5, 50, V, 10, 0, 3] * 2, dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.3, 0.8, 1.0, 0.05, 0.99] * 2)
    noise = torch.empty(n, V).exponential_(generator=gen)
    scaled = logits / temperature[:, None]
    k_full = torch.where(top_k > 0, top_k, V).clamp(max=V)
    filtered = _apply_top_k_top_p(scaled, k_full, top_p)
    expected = (filtered.softmax(-1) / noise).argmax(-1)
    got = _sampler(device)(*(t.to(device) for t in (logits, temperature, top_k, top_p, noise)),
                           max_batch=n, max_k=V)
    assert got.tolist() == expected.tolist()


def test_launch_policy_boundaries():
    from surge.kernels.sampling import CHUNK, FEW_ROWS, SINGLE_TILE_MAX, launch_policy

    # Single tile up to SINGLE_TILE_MAX, chunks beyond.
    assert launch_policy(1, SINGLE_TILE_MAX, 0).single_tile
    chunked = launch_policy(1, SINGLE_TILE_MAX + 1, 0)
    assert not chunked.single_tile and chunked.block == CHUNK and chunked.num_chunks == SINGLE_TILE_MAX // CHUNK + 1
    assert launch_policy(1, 151936, 0).num_chunks == 38  # Qwen3
    # Single-tile warps: 8..32 elements per thread: 2048 -> 4 warps, 2049 pads to 4096 -> 8.
    assert launch_policy(1, 2048, 0).num_warps == 4 and launch_policy(1, 2049, 0).num_warps == 8
    assert launch_policy(1, 10, 0).num_warps == 4 and launch_policy(1, SINGLE_TILE_MAX, 0).num_warps == 16
    # Chunked warps: a row alone on its SM gets 16 warps, up to FEW_ROWS rows.
    assert launch_policy(FEW_ROWS, 151936, 0).num_warps == 16 and launch_policy(FEW_ROWS + 1, 151936, 0).num_warps == 8
    # Candidate slots per lane fill a fixed scratch budget for max_batch rows: 64 up to 21 rows, then fewer.
    from surge.kernels.sampling import CANDIDATE_BUDGET, MAX_SLOTS, MIN_SLOTS
    assert CANDIDATE_BUDGET // (21 * 3 * 4 * CHUNK) >= MAX_SLOTS > CANDIDATE_BUDGET // (22 * 3 * 4 * CHUNK)
    assert launch_policy(21, 151936, 0).candidate_slots == 64 and launch_policy(22, 151936, 0).candidate_slots == 62
    assert launch_policy(256, 151936, 0).candidate_slots == 5
    assert launch_policy(4096, 151936, 0).candidate_slots == MIN_SLOTS
    assert launch_policy(1, SINGLE_TILE_MAX, 0).candidate_slots == 0  # registers hold the row
    # Fixed-point mass bits shrink once the vocabulary passes 2**18 (total * 2**24 must stay below 2**62).
    assert launch_policy(1, 2 ** 18, 0).weight_bits == 20 and launch_policy(1, 2 ** 18 + 1, 0).weight_bits == 19
    # max_k = 0 compiles the top-k search out.
    assert not launch_policy(1, V, 0).top_k and launch_policy(1, V, 1).top_k
    for bad in [dict(max_batch=0), dict(max_k=V + 1), dict(max_k=-1), dict(vocab_size=0)]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            launch_policy(**{**dict(max_batch=1, vocab_size=V, max_k=0), **bad})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_are_independent():
    """Capture once; every replay with new logits, k, p, temperatures and noise equals the reference: nothing the
    kernel keeps (it keeps no counters or scratch) carries over between replays."""
    from surge.kernels.sampling import launch_policy, sample_reference

    device = torch.device("cuda")
    n, vocab = 8, 151936
    launch = launch_policy(n, vocab, vocab)
    sampler = _sampler(device)
    static = dict(logits=torch.zeros(n, vocab, device=device), temperature=torch.ones(n, device=device),
                  top_k=torch.zeros(n, dtype=torch.int32, device=device), top_p=torch.ones(n, device=device),
                  noise=torch.ones(n, vocab, device=device))
    out = torch.empty(n, dtype=torch.int64, device=device)

    def run():
        sampler(static["logits"], static["temperature"], static["top_k"], static["top_p"], static["noise"],
                max_batch=n, max_k=vocab, out=out)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    gen = torch.Generator(device=device).manual_seed(0)
    for step in range(4):
        static["logits"].normal_(generator=gen).mul_(3)
        static["temperature"].copy_(torch.tensor([0.0, 1.0, 0.7, 1.0, 1.2, 0.0, 1.0, 0.5]))
        static["top_k"].copy_(torch.tensor([0, 50, 0, 1000, 0, 0, 5, 20 + step], dtype=torch.int32))
        static["top_p"].copy_(torch.tensor([1.0, 1.0, 0.9, 0.95, 0.5, 1.0, 1.0, 0.8 - 0.1 * step]))
        static["noise"].exponential_(generator=gen)
        graph.replay()
        expected = sample_reference(static["logits"], static["temperature"], static["top_k"], static["top_p"],
                                    static["noise"], launch.weight_bits)
        assert out.tolist() == expected.tolist(), step
