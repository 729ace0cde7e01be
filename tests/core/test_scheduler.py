"""Scheduler tests: unit cases for budgets, ordering, chunking, preemption, aborts and stop conditions, and randomized
workloads checked step by step against a plain sequential model and a fake paged KV store."""
from __future__ import annotations

import random

import pytest
import torch

from surge.config import SchedulerConfig
from surge.core.kv_cache.manager import KVCacheManager
from surge.core.kv_cache.spec import KVCacheConfig, SlidingWindowSpec, build_kv_cache_groups
from surge.core.scheduler import Scheduler, SchedulerOutput
from surge.engine.request import Request, RequestStatus
from surge.sampling_params import SamplingParams

BS = 4
V = 50


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_token(history: list[int]) -> int:
    """The fake model: deterministic in the whole history."""
    return (sum(history) * 31 + len(history)) % V


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """A plain sequential loop: what a request must produce however it is scheduled."""
    history, out = list(prompt), []
    while True:
        token = next_token(history)
        history.append(token)
        out.append(token)
        if len(out) >= max_tokens or len(history) >= max_model_len:
            return out


def make_request(rid: str, prompt: list[int], max_tokens: int = 16, **params) -> Request:
    params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **params}
    return Request(rid, prompt, SamplingParams(**params), BS)


def make_scheduler(num_blocks: int = 64, enable_caching: bool = False, hybrid_window: int | None = None,
                   **config) -> Scheduler:
    if hybrid_window is None:
        groups = build_kv_cache_groups(("full_attention",), None, BS, 2, 8, torch.float32)
    else:
        groups = build_kv_cache_groups(("sliding_attention", "full_attention"), hybrid_window, BS, 2, 8,
                                       torch.float32)
    config = {"max_num_batched_tokens": 64, "max_num_seqs": 8, "max_model_len": 64, **config}
    return Scheduler(SchedulerConfig(**config), KVCacheManager(KVCacheConfig(groups, num_blocks), enable_caching))


def step(sched: Scheduler) -> list[tuple[str, int, int, bool]]:
    """One engine step with the fake model; returns (request_id, num_computed, num_new, samples) as scheduled
    (`samples` reads the live request, so it is taken before the update appends a token)."""
    out = sched.schedule()
    plan = [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens, s.samples) for s in out.scheduled]
    sched.update_from_output(out, {s.request.request_id: next_token(s.request.token_ids)
                                   for s in out.scheduled if s.samples})
    return plan


def scheduled_tokens(plan: list[tuple[str, int, int, bool]]) -> dict[str, int]:
    return {rid: num_new for rid, _, num_new, _ in plan}


def assert_all_free(sched: Scheduler) -> None:
    for m in sched.kv.managers:
        assert m.pool.num_free_blocks == m.pool.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in m.pool.blocks[1:])


# ---------------------------------------------------------------------------------------------------------------
# Unit cases


def test_budget_and_max_num_seqs() -> None:
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [i] * 7, max_tokens=3))
    assert scheduled_tokens(step(sched)) == {"r0": 7, "r1": 3}  # budget 10 runs out in r1's prompt
    assert scheduled_tokens(step(sched)) == {"r0": 1, "r1": 4}  # max_num_seqs=2 keeps r2 waiting
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_running_requests_are_served_before_waiting_ones() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("old", [1, 2, 3], max_tokens=4))
    step(sched)
    sched.add_request(make_request("new", list(range(20)), max_tokens=4))
    plan = step(sched)
    assert [(rid, num_new) for rid, _, num_new, _ in plan] == [("old", 1), ("new", 7)]
    assert sched.requests["old"].num_output_tokens == 2


def test_chunked_prefill_splits_a_long_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    req = make_request("r", list(range(20)), max_tokens=2)
    sched.add_request(req)
    chunks = [step(sched) for _ in range(3)]
    assert chunks == [[("r", 0, 8, False)], [("r", 8, 8, False)], [("r", 16, 4, True)]]
    assert req.output_token_ids == reference_output(list(range(20)), 2, 64)[:1]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    sched.add_request(make_request("a", [1] * 10, max_tokens=4))
    sched.add_request(make_request("b", [2] * 10, max_tokens=4))
    assert scheduled_tokens(step(sched)) == {"a": 10}  # b's 10 tokens do not fit the 6 left: not chunked
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert scheduled_tokens(step(sched)) == {"a": 1, "b": 10}


@pytest.mark.parametrize("enable_caching", [False, True])
def test_preemption_frees_the_newest_and_recomputes_it(enable_caching: bool) -> None:
    # 4 real blocks: two requests of 7 prompt tokens fit (2 blocks each) until one crosses into a third block.
    sched = make_scheduler(num_blocks=5, enable_caching=enable_caching)
    a = make_request("a", list(range(7)), max_tokens=3)
    b = make_request("b", list(range(10, 17)), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    assert sched.num_preemptions == 0
    out = sched.schedule()  # a needs a third block; none is free
    assert out.preempted_ids == ["b"] and [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 1)]
    sched.update_from_output(out, {"a": next_token(a.token_ids)})
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert sched.waiting[0] is b and b not in sched.running
    assert sched.kv.get_block_ids("b") == ([],)
    assert a.is_finished and b.num_output_tokens == 2

    # Recomputed from scratch. With caching, b's first block is still cached (a took b's freed tail block first),
    # so one block comes back as a prefix hit.
    assert step(sched) == [("b", BS if enable_caching else 0, 9 - (BS if enable_caching else 0), True)]
    while sched.has_unfinished_requests():
        step(sched)
    assert a.output_token_ids == reference_output(list(range(7)), 3, 64)
    assert b.output_token_ids == reference_output(list(range(10, 17)), 3, 64)
    assert_all_free(sched)


def test_abort_waiting_running_and_preempted_requests_frees_their_blocks() -> None:
    sched = make_scheduler(num_blocks=5, max_num_seqs=2)
    a = make_request("a", list(range(7)), max_tokens=10)
    b = make_request("b", list(range(10, 17)), max_tokens=10)
    w = make_request("w", [3, 4], max_tokens=10)
    for r in (a, b, w):
        sched.add_request(r)
    step(sched)
    step(sched)
    step(sched)  # b is preempted
    assert b.status == RequestStatus.PREEMPTED and w.status == RequestStatus.WAITING
    assert list(sched.waiting) == [b, w]  # the preempted request goes back to the front
    free_before = sched.kv.managers[0].pool.num_free_blocks
    sched.abort_requests(["w", "b"])
    assert w.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.waiting and sched.kv.managers[0].pool.num_free_blocks == free_before

    out = sched.schedule()
    sched.abort_requests(["a"])  # aborted after scheduling: its result is dropped
    sched.update_from_output(out, {"a": 1})
    assert a.status == RequestStatus.FINISHED_ABORTED and a.num_output_tokens == 3  # no token appended
    assert not sched.has_unfinished_requests() and not sched.requests
    assert_all_free(sched)
    sched.abort_requests(["a", "never-seen"])  # a second abort and an unknown id are harmless


def run_tokens(sched: Scheduler, req: Request, tokens: list[int]) -> None:
    """Feed chosen sampled tokens one step at a time (the request is alone, so each step samples it)."""
    for token in tokens:
        out = sched.schedule()
        assert [s.request for s in out.scheduled if s.samples] == [req]
        sched.update_from_output(out, {req.request_id: token})


def test_finishes_at_max_tokens() -> None:
    sched = make_scheduler()
    req = make_request("r", [1, 2, 3], max_tokens=3)
    sched.add_request(req)
    run_tokens(sched, req, [5, 6])
    assert not req.is_finished
    run_tokens(sched, req, [7])
    assert req.status == RequestStatus.FINISHED_LENGTH and req.output_token_ids == [5, 6, 7]
    assert_all_free(sched)


def test_finishes_at_eos_not_before_min_tokens() -> None:
    eos = 9
    sched = make_scheduler()
    req = Request("r", [1, 2], SamplingParams(temperature=0, max_tokens=10, min_tokens=3, _eos_token_ids=(eos,)), BS)
    sched.add_request(req)
    run_tokens(sched, req, [eos, 4, eos])  # outputs 1 and 3; only the third reaches min_tokens
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    assert req.output_token_ids == [eos, 4, eos]
    assert_all_free(sched)

    ignoring = Request("i", [1, 2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                   _eos_token_ids=(eos,)), BS)
    sched.add_request(ignoring)
    run_tokens(sched, ignoring, [eos, eos])
    assert not ignoring.is_finished


def test_finishes_at_stop_token_ids() -> None:
    sched = make_scheduler()
    req = make_request("r", [1, 2], max_tokens=10, stop_token_ids=[13, 14])
    sched.add_request(req)
    run_tokens(sched, req, [5, 14])
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 14
    assert req.output_token_ids == [5, 14]


@pytest.mark.parametrize("max_tokens", [100, None])
def test_finishes_at_max_model_len(max_tokens: int | None) -> None:
    sched = make_scheduler(max_model_len=12)
    req = make_request("r", list(range(10)), max_tokens=max_tokens)
    sched.add_request(req)
    run_tokens(sched, req, [1])
    assert not req.is_finished
    run_tokens(sched, req, [2])
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 12
    assert_all_free(sched)


# ---------------------------------------------------------------------------------------------------------------
# Randomized workloads against the plain sequential model and a fake paged KV store


class FakeKVStore:
    """One slot list per block per group: the "KV" of a position is the token id written there."""

    def __init__(self, sched: Scheduler) -> None:
        self.specs = [m.group.spec for m in sched.kv.managers]
        self.slots = [dict() for _ in self.specs]

    def write(self, group: int, table: list[int], positions: range, token_ids: list[int]) -> None:
        for p in positions:
            block_id = table[p // BS]
            assert block_id != 0, f"position {p} computed into the null block"
            self.slots[group].setdefault(block_id, [None] * BS)[p % BS] = token_ids[p]

    def check_reads(self, group: int, table: list[int], start: int, end: int, token_ids: list[int]) -> None:
        """Positions [start, end) are being computed: everything they attend must hold the right tokens."""
        spec = self.specs[group]
        lo = max(0, start - spec.sliding_window + 1) if isinstance(spec, SlidingWindowSpec) else 0
        for q in range(lo, end):
            block_id = table[q // BS]
            assert block_id != 0, f"group {group}: position {q} is read from the null block"
            assert self.slots[group].get(block_id, [None] * BS)[q % BS] == token_ids[q], \
                f"group {group}: block {block_id} does not hold token {q}"


def check_step(sched: Scheduler, out: SchedulerOutput, kv_store: FakeKVStore, computed: dict[str, int]) -> None:
    config = sched.config
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert sched.num_running <= config.max_num_seqs
    assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
    for rid in out.preempted_ids:
        req = sched.requests[rid]
        assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0 and req in sched.waiting
        assert all(ids == [] for ids in sched.kv.get_block_ids(rid))
        computed[rid] = 0
    for s in out.scheduled:
        req, start = s.request, s.num_computed_tokens
        end = start + s.num_new_tokens
        assert s.num_new_tokens >= 1 and end <= req.num_tokens
        assert s.samples == (end == req.num_tokens)
        if start != computed[req.request_id]:  # only a fresh admission may skip tokens, through a prefix hit
            assert computed[req.request_id] == 0 and sched.kv.enable_caching and start % BS == 0, \
                (req.request_id, start, computed[req.request_id])
        for g, spec in enumerate(kv_store.specs):
            table = s.block_ids[g]
            assert len(table) >= cdiv(end, BS)
            if isinstance(spec, SlidingWindowSpec):  # blocks wholly before the window were handed back
                first_needed = max(0, start - spec.sliding_window + 1) // BS
                assert all(b == 0 for b in table[:first_needed])
                assert all(b != 0 for b in table[first_needed:cdiv(end, BS)])
            kv_store.write(g, table, range(start, end), req.token_ids)
    for s in out.scheduled:
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        for g in range(len(kv_store.specs)):
            kv_store.check_reads(g, s.block_ids[g], start, end, s.request.token_ids)
        computed[s.request.request_id] = end

    # Two running requests share a block only when it is a cached block holding the same prefix.
    for g, m in enumerate(sched.kv.managers):
        owner: dict[int, tuple[str, int]] = {}
        for req in sched.running:
            for i, block_id in enumerate(sched.kv.get_block_ids(req.request_id)[g]):
                if block_id == 0:
                    continue
                if block_id in owner:
                    block_hash = m.pool.blocks[block_id].block_hash
                    other = sched.requests[owner[block_id][0]]
                    assert block_hash is not None, f"group {g}: block {block_id} shared but not cached"
                    assert block_hash == req.block_hashes[i] == other.block_hashes[owner[block_id][1]]
                owner[block_id] = (req.request_id, i)
        held = sum(1 for b in m.pool.blocks[1:] if b.ref_cnt > 0)
        assert held + m.pool.num_free_blocks == m.pool.num_blocks - 1


def run_workload(seed: int, enable_caching: bool, hybrid: bool, enable_chunked_prefill: bool) -> dict[str, int]:
    rng = random.Random(seed)
    max_model_len = 48
    window = rng.choice([2, 5, 8, 13]) if hybrid else None
    budget = rng.choice([1, 3, 8, 16, 48]) if enable_chunked_prefill else max_model_len + rng.randint(0, 16)
    num_blocks = 1 + cdiv(max_model_len, BS) + rng.randint(0, 10)  # any single request always fits
    sched = make_scheduler(num_blocks=num_blocks, enable_caching=enable_caching, hybrid_window=window,
                           max_num_batched_tokens=budget, max_num_seqs=rng.randint(1, 6),
                           max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill)
    prefixes = [[rng.randrange(V) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    pending, expected = [], {}
    for i in range(14):
        prompt = rng.choice(prefixes) if rng.random() < 0.6 else []
        prompt = (prompt + [rng.randrange(V) for _ in range(rng.randint(0, 16))])[:max_model_len - 1] or [7]
        max_tokens = rng.randint(1, 20)
        rid = f"req{i}"
        pending.append((rng.randint(0, 30), make_request(rid, prompt, max_tokens)))
        expected[rid] = reference_output(prompt, max_tokens, max_model_len)
    kv_store, computed = FakeKVStore(sched), {}
    all_requests, aborted = {}, set()
    for step_index in range(3000):
        for arrival, req in [p for p in pending if p[0] <= step_index]:
            pending.remove((arrival, req))
            sched.add_request(req)
            all_requests[req.request_id] = req
            computed[req.request_id] = 0
        if sched.requests and rng.random() < 0.02:
            rid = rng.choice(sorted(sched.requests))
            sched.abort_requests([rid])
            aborted.add(rid)
        if not pending and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert not out.is_empty or not sched.has_unfinished_requests(), "nothing scheduled"
        check_step(sched, out, kv_store, computed)
        sampled = {s.request.request_id: next_token(s.request.token_ids) for s in out.scheduled if s.samples}
        sched.update_from_output(out, sampled)
    else:
        pytest.fail(f"seed {seed}: workload did not finish in 3000 steps")

    assert len(all_requests) == len(expected)
    for rid, req in all_requests.items():
        if rid in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            assert req.output_token_ids == expected[rid][:req.num_output_tokens]
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH
            assert req.output_token_ids == expected[rid], f"seed {seed}: {rid}"
    assert_all_free(sched)
    return {"preemptions": sched.num_preemptions, "prefix_hits": sched.kv.prefix_hits}


@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
@pytest.mark.parametrize("enable_chunked_prefill", [True, False], ids=["chunked", "whole"])
def test_random_workloads_match_the_sequential_model(enable_caching: bool, hybrid: bool,
                                                     enable_chunked_prefill: bool) -> None:
    totals = {"preemptions": 0, "prefix_hits": 0}
    for seed in range(12):
        for key, value in run_workload(seed, enable_caching, hybrid, enable_chunked_prefill).items():
            totals[key] += value
    # The workloads must exercise what they claim to test.
    assert totals["preemptions"] > 0
    assert (totals["prefix_hits"] > 0) == enable_caching
