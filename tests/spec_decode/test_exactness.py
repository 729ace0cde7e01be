"""Speculation changes nothing a request asked for: penalties, min_tokens, stop token ids, stop strings, logprobs and
max_tokens give the same output with drafts as without (greedy, so the reference is exact), and a stop that falls
inside an accepted run of drafts truncates it there. Both proposers: n-gram lookup, and a draft model (the target
itself: its greedy drafts run long, and penalties or min_tokens make the target reject some)."""
from __future__ import annotations

import pytest

from surge import LLM, SamplingParams
from tiny_models import make_tiny_model

from test_ngram import _prompts

BASE = dict(block_size=4, max_model_len=160, device="cpu", kv_cache_memory=1 << 22)
SPEC = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(model_dir, **BASE)


@pytest.fixture(scope="module", params=["ngram", "ngram-async", "draft_model", "draft_model-async"])
def engines(request, model_dir, plain):
    """-async: the drafts stay on the device (the n-gram lookup runs there) and steps are launched ahead of the
    verdict before them."""
    spec = SPEC if request.param.startswith("ngram") else {**SPEC, "method": "draft_model", "model": str(model_dir)}
    extra = {"async_scheduling": True} if request.param.endswith("-async") else {}
    return plain, LLM(model_dir, speculative_config=spec, **BASE, **extra), request.param


def _run(llm: LLM, params: SamplingParams, prompts=None):
    steps: list[list[int]] = []  # the tokens each request received per step
    sched = llm.engine.scheduler
    inner = sched.update_from_output

    def record(out, sampled, kv_output=None):
        steps.extend(sampled.values())
        return inner(out, sampled, kv_output)

    sched.update_from_output = record
    try:
        return llm.generate(prompts or _prompts(), params, use_tqdm=False), steps
    finally:
        sched.update_from_output = inner


def _compare(engines, params: SamplingParams):
    ref, _ = _run(engines[0], params)
    got, steps = _run(engines[1], params)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].text == r.outputs[0].text
        assert g.outputs[0].finish_reason == r.outputs[0].finish_reason
    assert any(len(s) > 1 for s in steps), "no draft was accepted: the comparison did not cover speculation"
    return ref, got, steps


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.05), dict(frequency_penalty=0.05),
                                       dict(presence_penalty=0.1)], ids=["repetition", "frequency", "presence"])
def test_penalties(engines, penalties):
    if engines[2].startswith("draft_model") and "repetition_penalty" not in penalties:
        pytest.skip("the penalties differ only in the verification, which both proposers share: one suffices here")
    _compare(engines, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **penalties))


def test_max_tokens(engines):
    """Drafts never run past max_tokens: the proposer asks for at most max_tokens - generated - 1 of them."""
    for max_tokens in (1, 2, 3, 5, 8, 13):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ref, _ = _run(engines[0], params)
        got, steps = _run(engines[1], params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        assert all(len(o.outputs[0].token_ids) == max_tokens and o.outputs[0].finish_reason == "length"
                   for o in got)
        assert max_tokens < 8 or any(len(s) > 1 for s in steps)


def _a_repeated_token(engines) -> tuple[int, int]:
    """A token the greedy outputs produce more than once, and the index of its second occurrence in output 0."""
    ref, _ = _run(engines[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    out = ref[0].outputs[0].token_ids
    for i, t in enumerate(out):
        if t in out[:i] and i >= 6:
            return t, i
    raise AssertionError("the tiny model's output repeats nothing")


def test_stop_token_inside_an_accepted_run_truncates_it(engines):
    """Pick a token whose first occurrence lands inside a multi-token step when nothing stops, then stop on it. The
    prompt quotes the model's own continuation, so a draft copied from the prompt brings a token the output has
    not had yet."""
    p0 = _prompts()[0]
    quoted, _ = _run(engines[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), [p0])
    prompt = [p0 + quoted[0].outputs[0].token_ids + p0]
    free, steps = _run(engines[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), prompt)
    seen, token = set(), None
    for run in steps:
        for t in run[:-1]:
            if t not in seen and token is None:
                token = t
        seen.update(run)
        if token is not None:
            break
    assert token is not None, "no step accepted a draft"
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[token])
    ref, _ = _run(engines[0], params, prompt)
    got, steps = _run(engines[1], params, prompt)
    out = got[0].outputs[0]
    assert out.token_ids == ref[0].outputs[0].token_ids and out.finish_reason == "stop"
    assert out.token_ids[-1] == token and len(out.token_ids) < len(free[0].outputs[0].token_ids)
    assert any(token in run[:-1] for run in steps)  # the step that found it carried tokens after it


def test_min_tokens_holds_back_a_stop_token(engines):
    token, second = _a_repeated_token(engines)
    _, got, _ = _compare(engines, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[token],
                                                 min_tokens=second))
    assert len(got[0].outputs[0].token_ids) > second - 1


def test_stop_string(engines):
    ref, _ = _run(engines[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = ref[0].outputs[0].text
    stop = text[20:22]
    assert stop and len(text) > 30
    _, got, _ = _compare(engines, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    assert got[0].outputs[0].finish_reason == "stop" and stop not in got[0].outputs[0].text


def test_logprobs(engines):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    ref, got, _ = _compare(engines, params)
    for r, g in zip(ref, got):
        assert len(g.outputs[0].logprobs) == len(r.outputs[0].logprobs) == 30
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert list(lr) == list(lg)  # same tokens in the same order (sampled first, then the top 3)
            for tid in lr:
                assert abs(lr[tid].logprob - lg[tid].logprob) < 1e-4 and lr[tid].rank == lg[tid].rank
        assert abs(r.outputs[0].cumulative_logprob - g.outputs[0].cumulative_logprob) < 1e-3
