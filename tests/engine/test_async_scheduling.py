"""Async scheduling (step N+1 launched before step N's tokens reach the host) against synchronous stepping, the
reference: every output, finish reason and logprob must be the same, whatever mix of requests is running."""
from __future__ import annotations

import pytest
import torch

from surge import LLM, SamplingParams
from surge.engine.core import EngineCore
from engine_steps import abort_while_in_flight
from tiny_models import make_tiny_model


@pytest.fixture(scope="module", params=["llama", "qwen3-hybrid"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (12,), generator=g).tolist()
    return [(shared if i % 2 == 0 else []) + torch.randint(3, 256, (int(torch.randint(2, 24, (1,), generator=g)),),
                                                          generator=g).tolist() for i in range(n)]


def _run(model_dir, prompts, params, async_scheduling: bool, **kwargs):
    llm = LLM(model_dir, block_size=4, max_model_len=64, async_scheduling=async_scheduling,
              **{"kv_cache_memory": 1 << 22, **kwargs})
    assert llm.engine.async_scheduling == async_scheduling
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.kv_cache_manager.usage == 0.0 and not llm.engine.has_unfinished_requests()
    return [(c.token_ids, c.finish_reason, c.stop_reason, _rounded(c.logprobs), _rounded(o.prompt_logprobs))
            for o in outs for c in o.outputs], llm


def _rounded(logprobs):
    """Token ids and ranks exactly; values to 1e-4 (batches are composed differently, so the float sums are too)."""
    if logprobs is None:
        return None
    return [None if d is None else {t: (round(lp.logprob, 4), lp.rank) for t, lp in d.items()} for d in logprobs]


def _mixed_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token]),  # ends mid-flight
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token], min_tokens=6),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),  # runs into max_model_len
    ]


@pytest.mark.parametrize("engine_kwargs", [
    {},  # whole prefills, prefix caching on
    {"max_num_batched_tokens": 5, "enable_prefix_caching": False},  # chunked prefill beside pending decodes
    {"num_gpu_blocks_override": 25, "kv_cache_memory": None},  # preemption while a token is in flight
], ids=["plain", "chunked", "preempted"])
def test_async_matches_sync(model_dir, engine_kwargs):
    prompts = _prompts(7)
    probe, _ = _run(model_dir, prompts[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), False)
    stop_token = probe[1][0][4]  # a token request 1 produces on its fifth step
    params = _mixed_params(stop_token)
    expected, sync_llm = _run(model_dir, prompts, params, False, **engine_kwargs)
    got, async_llm = _run(model_dir, prompts, params, True, **engine_kwargs)
    assert got == expected
    assert expected[1][1] == "stop" and expected[6][1] == "length"  # the cases meant are exercised
    if "num_gpu_blocks_override" in engine_kwargs:
        assert async_llm.engine.scheduler.num_preemptions > 0


def test_penalties_step_synchronously_and_match(model_dir):
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.4, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2
    expected, _ = _run(model_dir, prompts, params, False)
    got, _ = _run(model_dir, prompts, params, True)
    assert got == expected


def test_no_step_is_wasted_at_max_tokens(model_dir):
    """A request whose pending token reaches max_tokens is not scheduled again: 1 prefill + 7 decodes for 8."""
    engine = LLM(model_dir, block_size=4, kv_cache_memory=1 << 22, max_model_len=64, async_scheduling=True).engine
    launched = []
    inner = engine.executor.execute_async
    engine.executor.execute_async = lambda out: launched.append(len(out.scheduled)) or inner(out)
    from surge.core.request import Request
    engine.add_request(Request("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), 4))
    tokens, steps = [], 0
    while engine.has_unfinished_requests() and steps < 50:
        steps += 1
        for o in engine.step():
            tokens += o.new_token_ids
    assert len(tokens) == 8 and len(launched) == 8


def test_abort_with_a_step_in_flight(model_dir):
    llm = LLM(model_dir, block_size=4, kv_cache_memory=1 << 22, max_model_len=64, async_scheduling=True)
    engine: EngineCore = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = abort_while_in_flight(engine, params)
    alone, _ = _run(model_dir, [[9, 8, 7]], params, False)
    assert got["b"] == alone[0][0] and len(got["a"]) < 10
    assert engine.kv_cache_manager.usage == 0.0
