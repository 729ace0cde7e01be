"""The wire form of a step: a worker's request cache, fed only the encoded messages, must rebuild every step's
inputs exactly as the live scheduler output has them (tokens, positions, block tables, who samples), through
chunked prefill, preemption, aborts and finished requests, and forget requests once they finish."""
from __future__ import annotations

import random

import msgspec
import torch

from surge.config import SchedulerConfig
from surge.core.kv_cache.manager import KVCacheManager
from surge.core.kv_cache.spec import KVCacheConfig, build_kv_cache_groups
from surge.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from surge.engine.request import Request, RequestStatus
from surge.sampling_params import SamplingParams
from surge.worker.model_runner import ModelRunnerOutput
from surge.worker.step_message import RequestCache, StepEncoder, StepResult


def _view(out: SchedulerOutput) -> list[tuple]:
    """What a ModelRunner reads of a step."""
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens,
             s.request.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens],
             [list(b) for b in s.block_ids], s.samples, s.request.prompt_token_ids,
             s.request.output_token_ids, s.request.params) for s in out.scheduled]


def test_worker_cache_follows_the_scheduler():
    rng = random.Random(0)
    groups = build_kv_cache_groups(("sliding_attention", "full_attention"), 8, 4, 2, 8, torch.float32)
    # Few blocks and a small budget: chunked prefill and preemption both happen.
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64),
                      KVCacheManager(KVCacheConfig(groups, 18), enable_caching=True))
    encoder, cache = StepEncoder(), RequestCache(torch.device("cpu"))
    next_id = 0
    for step in range(300):
        if step < 120 and rng.random() < 0.3:
            prompt = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 30))]
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30), ignore_eos=True,
                                    repetition_penalty=1.2, seed=next_id)
            sched.add_request(Request(str(next_id), prompt, params, 4))
            next_id += 1
        if step % 17 == 5 and sched.running:
            sched.abort_requests([sched.running[-1].request_id])
        out = sched.schedule()
        if out.is_empty:
            if not sched.has_unfinished_requests() and step > 120:
                break
            continue
        rebuilt = cache.apply(cache.decode(encoder.encode(out)))
        assert _view(rebuilt) == _view(out)
        sampled = {s.request.request_id: rng.randrange(3, 50) for s in out.scheduled if s.samples}
        sched.update_from_output(out, sampled)
        if step % 11 == 3 and sched.running:
            sched.finish_request(sched.running[0].request_id, RequestStatus.FINISHED_STOPPED)
    assert sched.num_preemptions > 0
    assert not sched.has_unfinished_requests()
    # The last finished ones reach the workers with the next step that runs.
    sched.add_request(Request("last", [5, 6], SamplingParams(max_tokens=1), 4))
    cache.apply(cache.decode(encoder.encode(sched.schedule())))
    assert set(cache.requests) == {"last"} and set(encoder.known_tokens) == {"last"}


def test_recomputed_request_samples_only_at_its_end():
    """After preemption a request recomputes its tokens in chunks; a chunk that ends where the workers' copy ended
    before must not sample (the driver already holds one more token)."""
    req = Request("a", list(range(3, 10)), SamplingParams(temperature=0, max_tokens=8), 4)
    encoder, cache = StepEncoder(), RequestCache(torch.device("cpu"))
    blocks = ([1, 2, 3],)
    for computed, new, token in [(0, 7, 20), (7, 1, 21), (0, 8, None), (8, 1, 22)]:  # the third: after preemption
        out = SchedulerOutput([ScheduledRequest(req, computed, new, blocks, samples=token is not None)])
        assert _view(cache.apply(cache.decode(encoder.encode(out)))) == _view(out)
        if token is not None:
            req.append_token(token)


def test_result_round_trip():
    out = ModelRunnerOutput(sampled={"a": 3, "b": 7}, logprobs={"a": ([3, 1], [-0.5, -1.5], 1)},
                            prompt_logprobs={"b": (0, [[4, 4]], [[-0.1, -0.1]], [1])})
    data = StepResult.from_output(out)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(data), type=StepResult).to_output()
    assert back == out
