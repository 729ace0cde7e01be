"""The step message and the runner's own request state: a RequestStates fed only the encoded messages must hold
every step's inputs exactly as the live scheduler has them (tokens, block tables, who samples, parameters), through
chunked prefill, preemption, aborts and finished requests, and forget requests once they finish."""
from __future__ import annotations

import random

import msgspec
import torch

from surge.config import SchedulerConfig
from surge.core.kv_cache.manager import KVCacheManager
from surge.core.kv_cache.spec import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec, build_kv_cache_groups
from surge.core.request import Request, RequestStatus
from surge.core.scheduler import Scheduler
from surge.core.scheduler_output import SchedulerOutput
from surge.sampling_params import SamplingParams
from surge.worker.model_runner import ModelRunnerOutput
from surge.worker.request_state import RequestStates

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SchedulerOutput)


def _wire(out: SchedulerOutput) -> SchedulerOutput:
    return _decoder.decode(_encoder.encode(out))


def _live_view(sched: Scheduler, out: SchedulerOutput) -> list[tuple]:
    """What a ModelRunner must read of a step, from the engine's live objects."""
    view = []
    for s in out.scheduled:
        req = sched.requests[s.request_id]
        view.append((req.request_id, s.num_computed_tokens, s.num_new_tokens,
                     req.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens],
                     [list(b) for b in sched.kv.get_block_ids(req.request_id)], s.samples, req.prompt_token_ids,
                     req.output_token_ids, req.params))
    return view


def _runner_view(states: RequestStates, out: SchedulerOutput) -> list[tuple]:
    """The same, from the runner's state after it applied the (decoded) message."""
    msg = _wire(out)
    applied = states.apply(msg)
    return [(r.request_id, s.num_computed_tokens, s.num_new_tokens,
             r.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens],
             [list(b) for b in r.block_ids], s.samples, r.prompt_token_ids, r.output_token_ids, r.params)
            for s, r in zip(msg.scheduled, applied)]


def test_runner_state_follows_the_scheduler():
    rng = random.Random(0)
    groups = build_kv_cache_groups([SlidingWindowSpec(4, 2, 8, torch.float32, sliding_window=8), FullAttentionSpec(4, 2, 8, torch.float32)])
    # Few blocks and a small budget: chunked prefill and preemption both happen.
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64),
                      KVCacheManager(KVCacheConfig(groups, 18), enable_caching=True))
    states = RequestStates(len(groups), torch.device("cpu"))
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
        assert _runner_view(states, out) == _live_view(sched, out)
        sampled = {s.request_id: [rng.randrange(3, 50)] for s in out.scheduled if s.samples}
        sched.update_from_output(out, sampled)
        if step % 11 == 3 and sched.running:
            sched.finish_request(sched.running[0].request_id, RequestStatus.FINISHED_STOPPED)
    assert sched.num_preemptions > 0
    assert not sched.has_unfinished_requests()
    # The last finished ones reach the runner with the next step that runs.
    sched.add_request(Request("last", [5, 6], SamplingParams(max_tokens=1), 4))
    states.apply(_wire(sched.schedule()))
    assert set(states.requests) == {"last"} and set(sched._runner_tokens) == {"last"}


def test_recomputed_request_samples_only_at_its_end():
    """After preemption a request recomputes its tokens in chunks; a chunk that ends before its last known token
    must not sample (the engine already holds the tokens it would produce); the runner keeps its RNG meanwhile."""
    groups = build_kv_cache_groups([FullAttentionSpec(4, 2, 8, torch.float32)])
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, max_model_len=64),
                      KVCacheManager(KVCacheConfig(groups, 8), enable_caching=False))
    states = RequestStates(len(groups), torch.device("cpu"))
    req = Request("a", list(range(3, 10)), SamplingParams(temperature=0.5, seed=3, max_tokens=8), 4)
    sched.add_request(req)
    plans = []
    for token in (20, 21):
        out = sched.schedule()
        assert _runner_view(states, out) == _live_view(sched, out)
        plans.append([(s.num_computed_tokens, s.num_new_tokens, s.samples) for s in out.scheduled])
        sched.update_from_output(out, {"a": [token]})
    generator = states.requests["a"].generator
    sched._preempt(req)  # as the scheduler does when blocks run out
    sched.running.remove(req)
    for token in (None, 22):
        out = sched.schedule()
        assert _runner_view(states, out) == _live_view(sched, out)
        plans.append([(s.num_computed_tokens, s.num_new_tokens, s.samples) for s in out.scheduled])
        sched.update_from_output(out, {"a": [token]} if token is not None else {})
    assert plans == [[(0, 7, True)], [(7, 1, True)], [(0, 8, False)], [(8, 1, True)]]
    assert states.requests["a"].generator is generator
    assert req.output_token_ids == [20, 21, 22]


def test_result_round_trip():
    out = ModelRunnerOutput(sampled={"a": [3], "b": [7, 8]}, logprobs={"a": [([3, 1], [-0.5, -1.5], 1)]},
                            prompt_logprobs={"b": (0, [[4, 4]], [[-0.1, -0.1]], [1])})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=ModelRunnerOutput)
    assert back == out
