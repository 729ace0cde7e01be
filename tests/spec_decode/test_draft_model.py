"""The draft-model proposer. With the target itself as the draft every proposal is accepted (its KV, kept in the
target's blocks, matches the target's through chunked prefill, prefix-cache hits, preemption and TP=2), and greedy
output is identical to decoding without speculation; a different draft is verified exactly all the same."""
from __future__ import annotations

import pytest
from test_ngram import _prompts
from tiny_models import make_tiny_model

from surge import LLM, SamplingParams

BASE = {"block_size": 4, "max_model_len": 128, "device": "cpu"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {kind: make_tiny_model(kind, tmp_path_factory.mktemp(kind)) for kind in ("llama", "qwen3-hybrid")}


def _generate(llm: LLM, prompts, params, ahead: list[int] | None = None):
    """Outputs, and (drafts proposed, drafts accepted) over the run; ahead gains the drafts verified in steps
    scheduled ahead of their verdict."""
    counts = [0, 0, 0]
    sched = llm.engine.scheduler
    inner = sched.update_from_output

    def record(out, sampled, kv_output=None):
        for s in out.scheduled:
            if s.num_drafts and s.request_id in sampled:
                counts[0] += s.num_drafts
                counts[1] += len(sampled[s.request_id]) - 1
                counts[2] += s.device_drafts
        return inner(out, sampled, kv_output)

    sched.update_from_output = record
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if ahead is not None:
            ahead.append(counts[2])
        return outs, tuple(counts[:2])
    finally:
        sched.update_from_output = inner


def _spec(model, k: int) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


CASES = [("llama", k, engine) for k in (1, 3, 5) for engine in ("plain", "preempted-chunked")]
CASES += [("qwen3-hybrid", 3, "plain"), ("qwen3-hybrid", 5, "preempted-chunked")]
_REFERENCE: dict = {}
ENGINES = {"plain": {"kv_cache_memory": 1 << 22},
           "preempted-chunked": {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 16}}


@pytest.mark.parametrize(("kind", "k", "engine"), CASES, ids=[f"{m}-k{k}-{e}" for m, k, e in CASES])
def test_target_as_its_own_draft_accepts_everything(model_dirs, kind, k, engine):
    model_dir = model_dirs[kind]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts() + [p[::-1] for p in _prompts()]  # 8 requests: enough to run out of 40 blocks
    if (kind, engine) not in _REFERENCE:  # one reference per model and engine, shared by every k
        _REFERENCE[kind, engine] = LLM(model_dir, **BASE, **ENGINES[engine]).generate(prompts, params,
                                                                                     use_tqdm=False)
    ref = _REFERENCE[kind, engine]
    llm = LLM(model_dir, speculative_config=_spec(model_dir, k), **BASE, **ENGINES[engine])
    outs, (proposed, accepted) = _generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert proposed > 0 and accepted == proposed
    assert llm.engine.kv_cache_manager.usage == 0.0
    if engine == "preempted-chunked":
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_keep_the_drafts_kv(model_dirs):
    """A second round of prompts sharing the first round's prefixes starts from cached blocks that the draft wrote
    too: still every proposal accepted."""
    model_dir = model_dirs["qwen3-hybrid"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(model_dir, speculative_config=_spec(model_dir, 3), kv_cache_memory=1 << 22,
              enable_prefix_caching=True, **BASE)
    _generate(llm, _prompts(), params)
    again = [p + [7, 8, 9] for p in _prompts()]
    outs, (proposed, accepted) = _generate(llm, again, params)
    assert llm.engine.kv_cache_manager.prefix_hits > 0
    ref = LLM(model_dir, kv_cache_memory=1 << 22, **BASE).generate(again, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert proposed > 0 and accepted == proposed


@pytest.mark.parametrize("extra", [{"tensor_parallel_size": 2}, {"async_scheduling": True},
                                   {"tensor_parallel_size": 2, "async_scheduling": True}],
                         ids=["tp2", "async", "tp2-async"])
def test_tensor_parallel_and_async_scheduling(tmp_path, extra):
    """TP=2: the draft sharded like the target, rank 0's verdict broadcast. Async scheduling: the drafts stay on the
    device and each step is launched ahead of the verdict before it (the draft starts where that verdict ended), and
    nothing is lost between them."""
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(model_dir, kv_cache_memory=1 << 22, **BASE).generate(_prompts(), params, use_tqdm=False)
    llm = LLM(model_dir, speculative_config=_spec(model_dir, 3), kv_cache_memory=1 << 22, **extra, **BASE)
    try:
        ahead: list[int] = []
        outs, (proposed, accepted) = _generate(llm, _prompts(), params, ahead)
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert proposed > 0 and accepted == proposed
    assert (ahead[0] > 0) == bool(extra.get("async_scheduling"))


def test_a_different_draft_is_verified_exactly(tmp_path):
    """A draft with other weights (same vocabulary): proposals are often wrong, the output is the target's; sampled
    requests with a seed repeat themselves."""
    target = make_tiny_model("llama", tmp_path / "target")
    draft = make_tiny_model("qwen3", tmp_path / "draft", seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(target, kv_cache_memory=1 << 22, **BASE).generate(_prompts(), greedy, use_tqdm=False)
    llm = LLM(target, speculative_config=_spec(draft, 3), kv_cache_memory=1 << 22, **BASE)
    outs, (proposed, accepted) = _generate(llm, _prompts(), greedy)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert proposed > 0 and accepted < proposed
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(_prompts(), sampled, use_tqdm=False)]
    assert first == [o.outputs[0].token_ids for o in llm.generate(_prompts(), sampled, use_tqdm=False)]


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    target = make_tiny_model("llama", tmp_path / "target")
    draft = make_tiny_model("qwen3-moe", tmp_path / "draft")
    import json
    cfg = json.loads((draft / "config.json").read_text())
    cfg["vocab_size"] = 300
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(target, speculative_config=_spec(draft, 2), kv_cache_memory=1 << 22, **BASE)
