"""n-gram speculative decoding: the proposer against a plain scan, and greedy output identical with and without
speculation (k = 1, 3, 5), through prefix caching, chunked prefill and preemption, with drafts really accepted."""
from __future__ import annotations

import random

import pytest
import torch

from surge import LLM, SamplingParams
from surge.config import SpeculativeConfig
from surge.spec_decode.ngram import NgramProposer
from surge.worker.ngram_lookup import DeviceNgram
from ngram_reference import reference_propose
from tiny_models import make_tiny_model


def test_proposer_matches_a_plain_scan():
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        got = NgramProposer(SpeculativeConfig("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi)).propose(tokens)
        assert got == reference_propose(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_device_lookup_matches_a_plain_scan_through_appends():
    """The device twin over a batch of rows of different lengths, grown by appends as verdicts grow them (w tokens
    written, fewer kept), gives the plain scan's drafts in its valid columns and the row's last token after them."""
    rng = random.Random(1)
    for lo, hi, k in [(1, 4, 4), (2, 3, 1), (1, 1, 5), (3, 5, 3), (2, 8, 2), (4, 4, 4)]:
        ngram = DeviceNgram(SpeculativeConfig("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi), 64,
                            torch.device("cpu"))
        seqs = {f"r{i}": [rng.randrange(3) for _ in range(rng.randint(1, 12))] for i in range(11)}  # grows twice
        for rid, tokens in seqs.items():
            ngram.add(rid, torch.tensor(tokens))
        ngram.remove(["r3"])
        del seqs["r3"]
        for _ in range(10):
            rids = list(seqs)
            rows = torch.tensor([ngram.row_of[r] for r in rids])
            drafts, valid = ngram.propose(rows, max(len(t) for t in seqs.values()))
            for i, rid in enumerate(rids):
                want = reference_propose(seqs[rid], k, lo, hi)
                assert drafts[i, :valid[i]].tolist() == want, (seqs[rid], lo, hi, k)
                assert drafts[i, valid[i]:].tolist() == [seqs[rid][-1]] * (k - int(valid[i]))
            new = torch.tensor([[rng.randrange(3) for _ in range(k + 1)] for _ in rids])
            counts = torch.tensor([rng.randint(1, k + 1) for _ in rids])
            ngram.append(rows, new, counts)
            for i, rid in enumerate(rids):
                seqs[rid] += new[i, :counts[i]].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen3-hybrid"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def count_ahead(llm: LLM) -> list[int]:
    """Counts, in its one element, the request steps the engine schedules ahead of their verdict (device drafts)."""
    count, inner = [0], llm.engine.scheduler.schedule

    def schedule():
        out = inner()
        count[0] += sum(1 for s in out.scheduled if s.device_drafts)
        return out

    llm.engine.scheduler.schedule = schedule
    return count


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (quoting), so lookups find matches."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (6, 9, 13, 4):
        piece = torch.randint(3, 256, (n,), generator=g).tolist()
        out.append(piece * 3 + piece[:2])
    return out


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("engine", [dict(kv_cache_memory=1 << 22),
                                    dict(num_gpu_blocks_override=34, max_num_batched_tokens=16)],
                         ids=["plain", "preempted-chunked"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_identical_with_and_without_speculation(model_dir, k, engine, async_scheduling):
    """Under async scheduling the drafts are looked up on the device and most steps are launched before the verdict
    of the one before is back: they start where it ended, not where the host counted (every draft accepted).
    min_tokens = max_tokens as the benchmarks ask: with no stop token to hold back it does not delay speculation."""
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=40, ignore_eos=True)
    base = dict(block_size=4, max_model_len=128, device="cpu", **engine)
    ref = LLM(model_dir, **base).generate(_prompts(), params, use_tqdm=False)
    llm = LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": k},
              async_scheduling=async_scheduling, **base)
    ahead = count_ahead(llm)
    accepted = []
    inner = llm.engine.scheduler.update_from_output

    def count(out, sampled, kv_output=None):
        accepted.extend(len(tokens) - 1 for tokens in sampled.values())
        return inner(out, sampled, kv_output)

    llm.engine.scheduler.update_from_output = count
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert sum(accepted) > 0  # drafts were accepted, so the comparison covered speculation
    assert llm.engine.kv_cache_manager.usage == 0.0
    if "num_gpu_blocks_override" in engine:
        assert llm.engine.scheduler.num_preemptions > 0
    assert (ahead[0] > 0) == async_scheduling


@pytest.mark.parametrize("extra", [dict(async_scheduling=True), dict(tensor_parallel_size=2),
                                   dict(tensor_parallel_size=2, async_scheduling=True)],
                         ids=["async", "tp2", "tp2-async"])
def test_greedy_identical_under_async_scheduling_and_tensor_parallelism(tmp_path, extra):
    """Under async scheduling the drafts are looked up on the device and a request's next step is launched before
    its verdict is back. Under TP the ranks run the verification step like any other; rank 0 verifies, and with
    device drafts the others learn its verdicts by broadcast. A seeded sampled request beside the greedy one repeats
    itself run after run (its draws come from its own generator)."""
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)]
    base = dict(block_size=4, max_model_len=128, device="cpu", kv_cache_memory=1 << 22)
    prompts = _prompts()[:2]
    ref = LLM(model_dir, **base).generate(prompts, params, use_tqdm=False)
    llm = LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **base, **extra)
    ahead = count_ahead(llm)
    try:
        outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
    finally:
        llm.engine.shutdown()
    assert outs[0][0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert outs[0][1].outputs[0].token_ids == outs[1][1].outputs[0].token_ids
    assert (ahead[0] > 0) == bool(extra.get("async_scheduling"))
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_identical_through_prefix_cache_hits(tmp_path, async_scheduling):
    """A second round whose prompts extend the first round's starts from cached blocks (both KV groups of the hybrid
    model); drafts are verified over them as over computed ones, and blocks a step ahead of its verdict filled are
    cached only once their tokens are known."""
    model_dir = make_tiny_model("qwen3-hybrid", tmp_path / "hybrid")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = {"block_size": 4, "max_model_len": 128, "device": "cpu", "kv_cache_memory": 1 << 22}
    again = [p + p[:5] for p in _prompts()]
    ref = LLM(model_dir, enable_prefix_caching=False, **base).generate(again, params, use_tqdm=False)
    llm = LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              async_scheduling=async_scheduling, **base)
    ahead = count_ahead(llm)
    llm.generate(_prompts(), params, use_tqdm=False)
    stats = llm.engine.scheduler.spec_stats
    before, hits = stats.num_accepted_tokens, llm.engine.kv_cache_manager.prefix_hits
    outs = llm.generate(again, params, use_tqdm=False)
    assert llm.engine.kv_cache_manager.prefix_hits > hits
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert stats.num_accepted_tokens > before
    assert (ahead[0] > 0) == async_scheduling


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_steps_run_ahead_of_the_verdict_without_a_host_wait(tmp_path):
    """On the GPU (async scheduling by default, CUDA graphs, the Triton backend reading lengths from the device):
    greedy output equal to decoding without speculation, steps scheduled ahead of their verdict, and neither the
    inputs' preparation nor the device lookup makes a synchronizing call (torch's sync debug mode counts them).
    Both kernels of the path ran, each in the one variant the warm-up compiled."""
    import warnings

    model_dir = make_tiny_model("llama", tmp_path / "llama")
    engine = {"block_size": 16, "max_model_len": 256, "device": "cuda", "kv_cache_memory": 1 << 26,
              "max_num_seqs": 8}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    from surge.kernels.ahead_rows import _ahead_rows_kernel
    from surge.kernels.ngram import _ngram_step_kernel

    ref = LLM(model_dir, **engine).generate(_prompts(), params, use_tqdm=False)
    kernels = (_ngram_step_kernel, _ahead_rows_kernel)
    compiled = [_num_compiled(kernel) for kernel in kernels]
    llm = LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **engine)
    runner = llm.engine.executor.runner
    assert llm.engine.async_scheduling and runner.ngram is not None
    ahead, syncs = count_ahead(llm), []
    for name in ("prepare_inputs", "_propose_ngram"):
        inner = getattr(runner, name)

        def run(*args, _inner=inner, _name=name):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return _inner(*args)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    syncs.extend(_name for w in caught if "called a synchronizing CUDA operation" in str(w.message))
        setattr(runner, name, run)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert ahead[0] > 0 and llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert syncs == []
    # The warm-up compiled the one variant of each kernel that every launch used (a second would be a compile
    # inside a request; none: an earlier test compiled it).
    for kernel, before in zip(kernels, compiled):
        assert _num_compiled(kernel) - before <= 1, kernel


def _num_compiled(kernel) -> int:
    """Variants of a Triton kernel compiled in this process (its per-device caches)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())
