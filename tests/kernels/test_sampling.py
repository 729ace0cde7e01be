"""Triton greedy/top-k/top-p sampling: exactly the total-order reference (special values, ties, every launch
geometry, the lanes' fast path and its fall-backs), the torch Sampler's tokens, the launch policy, CUDA graphs."""
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
    bits = single.weight_bits
    return [single,
            SamplingLaunch(128, 2, False, 2, 4, 2, bits, True),  # chunked; candidates always fit
            SamplingLaunch(64, 4, False, 1, 4, 2, bits, True),  # crowded lanes overflow to the row
            SamplingLaunch(64, 4, False, 0, 4, 2, bits, True),  # every search visits the row
            # The lanes' top 4: lanes of at most 2 elements keep the whole row, so every top-k/top-p row takes it;
            SamplingLaunch(128, 2, False, 2, 4, 2, bits, True, lane_top=True),
            # lanes of 6-7 elements: rows where the kept ones provably hold the survivors, the rest fall back;
            SamplingLaunch(32, 7, False, 2, 4, 2, bits, True, lane_top=True),
            # 64 kept, fewer than some k: those fall back, to the row since no candidate scratch.
            SamplingLaunch(16, 13, False, 0, 4, 2, bits, True, lane_top=True)]


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
    for launch in [None, *_launches()[4:]]:
        got = _sampler(device)(*(t.to(device) for t in (logits, temperature, top_k, top_p, noise)),
                               max_batch=n, max_k=V, launch=launch)
        assert got.tolist() == expected.tolist(), launch


def test_launch_policy_boundaries():
    from surge.kernels.sampling import CHUNK, SINGLE_TILE_MAX, launch_policy

    # Single tile up to SINGLE_TILE_MAX, chunks beyond, and only chunks keep the lanes' top 4.
    assert launch_policy(1, SINGLE_TILE_MAX, 0).single_tile and not launch_policy(1, SINGLE_TILE_MAX, V).lane_top
    chunked = launch_policy(1, SINGLE_TILE_MAX + 1, 0)
    assert not chunked.single_tile and chunked.block == CHUNK and chunked.num_chunks == SINGLE_TILE_MAX // CHUNK + 1
    assert chunked.lane_top and launch_policy(4096, 151936, 151936).lane_top
    assert CHUNK == 2048 and launch_policy(1, 151936, 0).num_chunks == 75  # Qwen3
    # Single-tile warps: 8..32 elements per thread: 2048 -> 4 warps, 2049 pads to 4096 -> 8.
    assert launch_policy(1, 2048, 0).num_warps == 4 and launch_policy(1, 2049, 0).num_warps == 8
    assert launch_policy(1, 10, 0).num_warps == 4 and launch_policy(1, SINGLE_TILE_MAX, 0).num_warps == 16
    # Chunked warps: 16 at every batch (the register vectors fit 128 registers per thread).
    assert {launch_policy(b, 151936, 151936).num_warps for b in (1, 128, 129, 256, 4096)} == {16}
    # Candidate slots per lane fill a fixed scratch budget for max_batch rows: 64 up to 42 rows, then fewer.
    from surge.kernels.sampling import CANDIDATE_BUDGET, MAX_SLOTS, MIN_SLOTS
    assert CANDIDATE_BUDGET // (42 * 3 * 4 * CHUNK) >= MAX_SLOTS > CANDIDATE_BUDGET // (43 * 3 * 4 * CHUNK)
    assert launch_policy(42, 151936, 0).candidate_slots == 64 and launch_policy(43, 151936, 0).candidate_slots == 63
    assert launch_policy(256, 151936, 0).candidate_slots == 10
    assert launch_policy(683, 151936, 0).candidate_slots == MIN_SLOTS == launch_policy(4096, 151936, 0).candidate_slots
    assert launch_policy(546, 151936, 0).candidate_slots == 5
    assert launch_policy(1, SINGLE_TILE_MAX, 0).candidate_slots == 0  # registers hold the row
    # Fixed-point mass bits shrink once the vocabulary passes 2**18 (total * 2**24 must stay below 2**62).
    assert launch_policy(1, 2 ** 18, 0).weight_bits == 20 and launch_policy(1, 2 ** 18 + 1, 0).weight_bits == 19
    # max_k = 0 compiles the top-k search out.
    assert not launch_policy(1, V, 0).top_k and launch_policy(1, V, 1).top_k
    # Geometry is chosen from capacities alone: the same arguments, the same launch.
    assert launch_policy(256, 151936, 151936) == launch_policy(256, 151936, 151936)
    for bad in [dict(max_batch=0), dict(max_k=V + 1), dict(max_k=-1), dict(vocab_size=0)]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            launch_policy(**{**dict(max_batch=1, vocab_size=V, max_k=0), **bad})


def _qwen_rows(gen):
    """Rows at the Qwen3 vocabulary for the default (chunked, lanes' top 4) launch, each meant for one branch."""
    vocab = 151936
    peaked = torch.randn(vocab, generator=gen) * 2
    peaked[torch.randint(0, vocab, (16,), generator=gen)] += torch.rand(16, generator=gen) * 6 + 10
    crowded = peaked.clone()
    crowded[torch.arange(6) * 2048 + 5] = 40.0  # lane 5 holds 6 tied maxima: more than it keeps
    crowded_p = peaked.clone()
    crowded_p[torch.arange(6) * 2048 + 7] = 40.0  # the same for top-p: the cut falls among lane 7's six
    rows = [  # (logits, temperature, top_k, top_p)
        (peaked, 1.0, 50, 0.9),  # fast path, top-k then top-p
        (peaked, 0.7, 50, 1.0),  # fast path, top-k alone
        (peaked, 1.0, 0, 0.9),  # fast path, top-p alone (one more pass for the row's mass)
        (crowded, 1.0, 3, 1.0),  # the kept ones cannot hold the ties at the cut: general path
        (torch.randn(vocab, generator=gen) * 0.5, 1.0, 0, 0.9),  # flat: the nucleus is wider than the kept ones
        (crowded_p, 1.0, 0, 0.3),  # general path on the candidates above the floor the lanes found
        (torch.randn(vocab, generator=gen) * 4, 1.0, 0, 0.9),  # a wide nucleus (hundreds of tokens)
        (peaked, 1.0, 256, 1.0),  # LANE_TOP_MAX_K: tries the lanes
        (peaked, 1.0, 257, 1.0),  # LANE_TOP_MAX_K + 1: the general path at once
        (peaked, 0.0, 50, 0.9),  # greedy
    ]
    logits = torch.stack([r[0] for r in rows])
    temperature = torch.tensor([r[1] for r in rows])
    top_k = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    top_p = torch.tensor([r[3] for r in rows])
    noise = torch.empty(len(rows), vocab).exponential_(generator=gen)
    noise[0, :100] = 0.0  # a zero draw counts as float32's tiny, in kernel and reference alike
    return logits, temperature, top_k, top_p, noise


def test_fast_path_and_its_fallbacks_at_the_qwen3_vocabulary(device):
    from surge.kernels.sampling import LANE_TOP_MAX_K, launch_policy, sample_reference

    assert LANE_TOP_MAX_K == 256
    args = tuple(t.to(device) for t in _qwen_rows(torch.Generator().manual_seed(11)))
    vocab = args[0].shape[1]
    launch = launch_policy(256, vocab, vocab)
    assert launch.lane_top and not launch.single_tile
    expected = sample_reference(*args, launch.weight_bits)
    got = _sampler(device)(*args, max_batch=256, max_k=vocab)
    assert got.tolist() == expected.tolist()
    assert got[3] in (torch.arange(6) * 2048 + 5).tolist()  # the only survivors of top-k 3 are the tied maxima
    assert got[5] in (torch.arange(2) * 2048 + 7).tolist()  # top-p 0.3 keeps the first two of six tied maxima


# ---- the Sampler's kernel path: the torch path's tokens from the same noise ----

SAMPLER_VOCAB = 20000  # chunked (over SINGLE_TILE_MAX): the lanes' fast path and its fall-backs


def _separated_logits(n, dtype, gen):
    """Low random logits under 64 distinct values at random places: no ties where top-k and top-p cut (bf16 too)."""
    logits = (torch.randn(n, SAMPLER_VOCAB, generator=gen) * 1.5).clamp(max=5.0)
    top = 8.0 + torch.arange(64) / 16  # exact in bf16
    for i in range(n):
        logits[i, torch.randperm(SAMPLER_VOCAB, generator=gen)[:64]] = top[torch.randperm(64, generator=gen)]
    return logits.to(dtype)


def _mixed_rows(device, step, penalties):
    from surge.model.layers.sampler import SamplingRow
    from surge.sampling_params import SamplingParams

    specs = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=50, seed=1),
             dict(top_p=0.9), dict(temperature=1.2, top_k=20, top_p=0.8, seed=2), dict(top_k=1),
             dict(top_p=1e-6, seed=3), dict(temperature=0.5, top_k=50, top_p=0.9, logprobs=2),
             dict(top_k=SAMPLER_VOCAB), dict(temperature=0.0, min_p=0.5)]  # top-k of the whole row: off
    if penalties:  # the whole batch then samples from a float32 copy
        specs += [dict(temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.5),
                  dict(top_k=5, min_tokens=4, stop_token_ids=[0, 1])]
    rows = []
    for spec in specs:
        seed = spec.pop("seed", None)
        gen = torch.Generator(device=device).manual_seed(seed + 100 * step) if seed is not None else None
        rows.append(SamplingRow(SamplingParams(**spec), [2, 3, 4], [5, 5, 6], gen))
    return rows


@pytest.mark.parametrize("penalties", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_kernel_path_draws_the_torch_paths_tokens(device, dtype, penalties):
    """Mixed batches (greedy, seeded and shared-RNG rows, top-k, top-p, both, logprobs; penalties and min_tokens or
    not): the kernel path and the torch path agree token for token, and neither writes the caller's logits."""
    from surge.model.layers.sampler import Sampler

    gen = torch.Generator().manual_seed(4)
    for step in range(2):
        logits = _separated_logits(len(_mixed_rows(device, step, penalties)), dtype, gen).to(device)
        original = logits.clone()
        outs = []
        for use_kernel in (True, False):
            torch.manual_seed(1000 + step)  # shared-RNG rows: the same draws on both paths
            sampler = Sampler(use_kernel=use_kernel)
            rows = _mixed_rows(device, step, penalties)
            assert sampler._kernel_serves(logits, rows) == use_kernel
            outs.append(sampler(logits, rows))
        sampled = outs[0].sampled_token_ids
        assert sampled.tolist() == outs[1].sampled_token_ids.tolist(), step
        assert torch.equal(outs[0].logprobs, outs[1].logprobs) and torch.equal(logits, original)
        assert sampled[0] == logits[0].float().argmax() and sampled[5] == logits[5].float().argmax()
        assert not penalties or sampled[11] not in (0, 1)


def test_sampler_splits_batches_between_kernel_and_torch(device, monkeypatch):
    """The kernel takes a batch when some sampling row asks for top-k or top-p and none for min-p, the one filter
    it lacks (a greedy row's filters do not count)."""
    from surge.model.layers.sampler import Sampler, SamplingRow
    from surge.sampling_params import SamplingParams

    sampler = Sampler(use_kernel=True)
    logits = _separated_logits(3, torch.float32, torch.Generator().manual_seed(2)).to(device)
    greedy_min_p = [SamplingRow(SamplingParams(temperature=0.0, min_p=0.3), [], []),
                    SamplingRow(SamplingParams(top_k=5), [], [])]
    assert sampler._kernel_serves(logits, greedy_min_p)
    rows = greedy_min_p + [SamplingRow(SamplingParams(min_p=0.1), [], [])]
    assert not sampler._kernel_serves(logits, rows)
    monkeypatch.setattr(Sampler, "_sample_with_kernel", lambda *a: pytest.fail("min_p went to the kernel"))
    torch.manual_seed(0)
    got = sampler(logits, rows).sampled_token_ids
    torch.manual_seed(0)
    assert got.tolist() == Sampler(use_kernel=False)(logits, rows).sampled_token_ids.tolist()
    assert not Sampler()._kernel_serves(logits.cpu(), greedy_min_p)  # by default the CPU keeps torch
    # Temperature alone (top-k of the whole row counts as none) is a softmax and an argmax: torch's.
    plain = [SamplingRow(SamplingParams(temperature=0.7, top_k=SAMPLER_VOCAB), [], []),
             SamplingRow(SamplingParams(temperature=0.0, top_k=5), [], [])]
    assert not sampler._kernel_serves(logits[:2], plain)
    assert sampler._kernel_serves(logits[:3], plain + [SamplingRow(SamplingParams(top_p=0.99), [], [])])


def test_sampler_warm_up_compiles_every_key_a_step_launches(device, monkeypatch, caplog):
    """warm_up registers the model dtype's key and the float32 one (penalties); steps up to max_batch rows, with and
    without penalties, launch nothing else: no compile lands inside a request."""
    from surge.kernels.sampling import TopKTopPSampler
    from surge.model.layers.sampler import Sampler, SamplingRow
    from surge.sampling_params import SamplingParams

    if device.type == "cpu":  # the interpreter compiles nothing; record the keys instead
        monkeypatch.setattr(TopKTopPSampler, "compile", lambda self, key: None)
    sampler = Sampler(use_kernel=True)
    assert sampler.warm_up(device, 8, SAMPLER_VOCAB, torch.bfloat16, max_workers=2) >= 0.0
    kernel = sampler._kernel
    assert len(kernel._compiled) == 2
    logits = _separated_logits(8, torch.bfloat16, torch.Generator().manual_seed(3)).to(device)
    with caplog.at_level("WARNING"):
        for n, params in [(8, SamplingParams(top_k=50)), (3, SamplingParams(top_p=0.9, presence_penalty=1.0))]:
            sampler(logits[:n], [SamplingRow(params, [1], [2]) for _ in range(n)])
    assert len(kernel._compiled) == 2 and "after warm-up" not in caplog.text
    assert Sampler(use_kernel=False).warm_up(device, 8, SAMPLER_VOCAB, torch.bfloat16) == 0.0
    with pytest.raises(ValueError, match="max_batch"):
        sampler.warm_up(device, 0, SAMPLER_VOCAB, torch.bfloat16)


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
