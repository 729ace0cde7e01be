"""Scheduler tests: unit cases for budgets, ordering, chunking, preemption, aborts, stop conditions and draft-token
rollback, and randomized workloads (async scheduling and draft tokens included) checked step by step against a plain
sequential model, a fake runner fed only by the step messages, and a fake paged KV store."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from surge.config import SchedulerConfig
from surge.core.kv_cache.manager import KVCacheManager
from surge.core.kv_cache.spec import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec, build_kv_cache_groups
from surge.core.scheduler import Scheduler, SchedulerOutput
from surge.core.request import Request, RequestStatus
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
                   num_device_drafts: int = 0, **config) -> Scheduler:
    if hybrid_window is None:
        groups = build_kv_cache_groups([FullAttentionSpec(BS, 2, 8, torch.float32)])
    else:
        groups = build_kv_cache_groups([SlidingWindowSpec(BS, 2, 8, torch.float32, sliding_window=hybrid_window),
                                        FullAttentionSpec(BS, 2, 8, torch.float32)])
    config = {"max_num_batched_tokens": 64, "max_num_seqs": 8, "max_model_len": 64, **config}
    return Scheduler(SchedulerConfig(**config), KVCacheManager(KVCacheConfig(groups, num_blocks), enable_caching),
                     num_device_drafts=num_device_drafts)


def step(sched: Scheduler) -> list[tuple[str, int, int, bool]]:
    """One engine step with the fake model; returns (request_id, num_computed, num_new, samples) as scheduled
    (the sampled token reads the live request, so it is taken before the update appends it)."""
    out = sched.schedule()
    plan = [(s.request_id, s.num_computed_tokens, s.num_new_tokens, s.samples) for s in out.scheduled]
    sched.update_from_output(out, {s.request_id: [next_token(sched.requests[s.request_id].token_ids)]
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
    assert out.preempted_ids == ["b"]
    assert [(sched.requests[s.request_id], s.num_new_tokens) for s in out.scheduled] == [(a, 1)]
    sched.update_from_output(out, {"a": [next_token(a.token_ids)]})
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
    sched.update_from_output(out, {"a": [1]})
    assert a.status == RequestStatus.FINISHED_ABORTED and a.num_output_tokens == 3  # no token appended
    assert not sched.has_unfinished_requests() and not sched.requests
    assert_all_free(sched)
    sched.abort_requests(["a", "never-seen"])  # a second abort and an unknown id are harmless


def run_tokens(sched: Scheduler, req: Request, tokens: list[int]) -> None:
    """Feed chosen sampled tokens one step at a time (the request is alone, so each step samples it)."""
    for token in tokens:
        out = sched.schedule()
        assert [sched.requests[s.request_id] for s in out.scheduled if s.samples] == [req]
        sched.update_from_output(out, {req.request_id: [token]})


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


def test_rejected_drafts_roll_back_and_free_the_blocks_past_the_new_end() -> None:
    sched = make_scheduler(num_blocks=8)
    pool = sched.kv.managers[0].pool
    prompt = [1, 2, 3, 4, 5]
    req = make_request("r", prompt, max_tokens=8)
    sched.add_request(req)
    step(sched)  # the prompt: 5 tokens computed, one sampled
    assert (req.num_computed_tokens, req.num_tokens) == (5, 6)
    right = next_token(req.token_ids)
    wrong = (next_token(req.token_ids + [right]) + 1) % V
    req.spec_token_ids = [right, wrong, 7]
    assert sched.needs_output_history()  # the proposer needs this step's tokens before the next step

    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_computed_tokens, s.num_new_tokens, s.samples, s.spec_token_ids) == (5, 4, True, [right, wrong, 7])
    assert s.new_token_ids == req.output_token_ids  # the token sampled last step
    table = sched.kv.get_block_ids("r")[0]
    assert len(table) == cdiv(5 + 4, BS) == 3
    assert sched.schedule().is_empty  # while its drafts are in flight the request waits for their verdict
    free_before = pool.num_free_blocks

    bonus = next_token(req.token_ids + [right])
    assert sched.update_from_output(out, {"r": [right, bonus]}) == [(req, [right, bonus])]
    # One draft accepted, two rejected: positions 7 and 8 held rejected drafts and are computed again.
    assert (req.num_computed_tokens, req.num_tokens) == (9 - 2, 8)
    assert sched.kv.get_block_ids("r") == (table[:cdiv(7, BS)],)
    assert pool.num_free_blocks == free_before + 1 and pool.blocks[table[2]].ref_cnt == 0

    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_computed_tokens, s.num_new_tokens, s.spec_token_ids) == (7, 1, [])
    assert s.new_token_ids == [right, bonus]
    assert (s.block_starts, s.new_block_ids) == ([2], [[]])  # the runner cuts its table after two blocks
    sched.update_from_output(out, {"r": [next_token(req.token_ids)]})
    while sched.has_unfinished_requests():
        step(sched)
    assert req.output_token_ids == reference_output(prompt, 8, 64)
    assert_all_free(sched)


def test_a_request_preempted_with_drafts_in_flight_keeps_no_rollback() -> None:
    # 4 real blocks: a (7 prompt tokens) and b (3, then 4 positions with its drafts) take 2 each; a's next token
    # needs a third block, so b is preempted while its drafts are in flight.
    sched = make_scheduler(num_blocks=5)
    a = make_request("a", list(range(7)), max_tokens=6)
    b = make_request("b", [11, 12, 13], max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    right = next_token(b.token_ids)
    b.spec_token_ids = [right, (next_token(b.token_ids + [right]) + 1) % V, 3]
    first = sched.schedule()
    assert [(s.request_id, s.num_new_tokens, len(s.spec_token_ids)) for s in first.scheduled] == [("a", 1, 0),
                                                                                                 ("b", 4, 3)]
    second = sched.schedule()  # launched before the first step's result, as under async scheduling
    assert second.preempted_ids == ["b"] and [s.request_id for s in second.scheduled] == ["a"]
    b_tokens = [right, next_token(b.token_ids + [right])]  # one draft accepted, two rejected
    sched.update_from_output(first, {"a": [next_token(a.token_ids)], "b": b_tokens})
    # Preempted: it restarts from 0 whatever was accepted; only its tokens are appended.
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_pending_tokens == 0
    assert b.output_token_ids[1:] == b_tokens and sched.kv.get_block_ids("b") == ([],)
    sched.update_from_output(second, {"a": [next_token(a.token_ids)]})
    while sched.has_unfinished_requests():
        step(sched)
    assert a.output_token_ids == reference_output(list(range(7)), 6, 64)
    assert b.output_token_ids == reference_output([11, 12, 13], 8, 64)
    assert_all_free(sched)


# ---------------------------------------------------------------------------------------------------------------
# Randomized workloads against the plain sequential model, a fake runner and a fake paged KV store


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


class FakeRunner:
    """The model runner's side, fed only by the step messages: its copy of each request's tokens and per-group block
    tables, and the device's history of each request (those tokens plus the ones it sampled itself, ahead of the
    host while a step is in flight). A step runs at launch, as on a device: it writes the KV of the scheduled
    positions (the history, then the drafts), checks what they read, and verifies the drafts against the model.
    A step scheduled ahead of its verdict (device drafts) starts where the device's history ends, which must be
    where the host counted less the drafts the step before rejected; its drafts follow the model with
    probability 0.7, as the host proposer's."""

    def __init__(self, sched: Scheduler, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random(0)
        self.rejected: dict[str, int] = {}  # request id -> drafts its last verifying step rejected
        self.kv_store = FakeKVStore(sched)
        self.num_groups = len(self.kv_store.specs)
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.device: dict[str, list[int]] = {}
        self.stats: Counter[str] = Counter()

    def apply_message(self, out: SchedulerOutput) -> None:
        for rid in out.finished_ids:
            assert rid in self.tokens, f"{rid}: told to drop a request it does not hold"
            del self.tokens[rid], self.tables[rid], self.device[rid]
        for new in out.new_requests:
            rid = new.request_id
            assert rid not in self.tokens, f"{rid}: sent as new twice"
            self.tokens[rid], self.device[rid] = list(new.prompt_token_ids), list(new.prompt_token_ids)
            self.tables[rid] = [[] for _ in range(self.num_groups)]
        for s in out.scheduled:
            tokens, tables = self.tokens[s.request_id], self.tables[s.request_id]
            tokens.extend(s.new_token_ids)
            assert self.device[s.request_id][:len(tokens)] == tokens, "the host sent tokens the device did not sample"
            assert len(s.block_starts) == len(s.new_block_ids) == self.num_groups
            for g, (start, block_ids) in enumerate(zip(s.block_starts, s.new_block_ids)):
                assert 0 <= start <= len(tables[g]), f"{s.request_id}: group {g} diff starts past the table's end"
                tables[g] = tables[g][:start] + block_ids

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Returns, per sampling request, the accepted drafts plus one bonus (or correcting) token."""
        drafts, starts = {}, {}
        for s in out.scheduled:
            rid, history = s.request_id, self.device[s.request_id]
            drafts[rid], starts[rid] = s.spec_token_ids, s.num_computed_tokens
            if s.device_drafts:
                starts[rid] = len(history) - 1  # the newest token, sampled by the step before, is computed first
                assert s.num_new_tokens == 1 + s.device_drafts
                assert s.num_computed_tokens - starts[rid] == self.rejected.get(rid, 0), rid
                drafts[rid] = []
                for _ in range(s.device_drafts):
                    drafts[rid].append(next_token(history + drafts[rid]) if self.rng.random() < 0.7
                                       else self.rng.randrange(V))
        sequences = {rid: self.device[rid] + d for rid, d in drafts.items()}
        for s in out.scheduled:
            positions = range(starts[s.request_id], starts[s.request_id] + s.num_new_tokens)
            for g in range(self.num_groups):
                self.kv_store.write(g, self.tables[s.request_id][g], positions, sequences[s.request_id])
        sampled = {}
        for s in out.scheduled:
            start = starts[s.request_id]
            end = start + s.num_new_tokens
            for g in range(self.num_groups):
                self.kv_store.check_reads(g, self.tables[s.request_id][g], start, end, sequences[s.request_id])
            if not s.samples:
                continue
            history, accepted = self.device[s.request_id], []
            for draft in drafts[s.request_id]:
                if draft != next_token(history + accepted):
                    break
                accepted.append(draft)
            sampled[s.request_id] = accepted + [next_token(history + accepted)]
            history.extend(sampled[s.request_id])
            self.rejected[s.request_id] = len(drafts[s.request_id]) - len(accepted)
            self.stats["drafts"] += len(drafts[s.request_id])
            self.stats["device_drafts"] += s.device_drafts
            self.stats["accepted"] += len(accepted)
            self.stats["rollbacks"] += len(accepted) < len(drafts[s.request_id])
        return sampled


def check_step(sched: Scheduler, out: SchedulerOutput, runner: FakeRunner, computed: dict[str, int]) -> None:
    """Right after schedule(): the message keeps the limits, and the runner's copy rebuilt from it equals the
    scheduler's tokens and block tables."""
    config = sched.config
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert sched.num_running <= config.max_num_seqs
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    for rid in out.preempted_ids:
        req = sched.requests[rid]
        assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0 and req in sched.waiting
        assert all(ids == [] for ids in sched.kv.get_block_ids(rid))
        computed[rid] = 0
    if not out.is_empty:  # an empty output (it may still preempt) is never executed: the runner never sees it
        runner.apply_message(out)
        assert set(runner.tokens) <= set(sched.requests), "the runner was not told that a request finished"
    for s in out.scheduled:
        rid, start = s.request_id, s.num_computed_tokens
        req, end = sched.requests[rid], start + s.num_new_tokens
        assert runner.tokens[rid] == req.token_ids
        assert runner.tables[rid] == list(sched.kv.get_block_ids(rid))
        # The device is ahead of the host by the token(s) of the request's step still in flight: one, or with
        # drafts 1 + those accepted (and a step scheduled ahead of that verdict starts where it really ended).
        device = runner.device[rid]
        if s.device_drafts:
            assert req.num_pending_tokens == 2 and 1 <= len(device) - req.num_tokens <= 1 + req.num_spec_in_flight
            true_start = len(device) - 1
            assert true_start <= start and end + 1 <= config.max_model_len  # even with every draft accepted
        else:
            assert len(device) - req.num_tokens == req.num_pending_tokens - s.samples
            true_start = start
            # The request's tokens as the device sees them: its history, then the drafts to verify.
            num_tokens = len(device) + len(s.spec_token_ids)
            assert s.num_new_tokens >= 1 and end <= num_tokens
            assert s.samples == (end == num_tokens)
            assert not s.spec_token_ids or s.samples
        assert end < config.max_model_len  # the token at max_model_len - 1 is sampled, never computed
        if start != computed[rid]:  # only a fresh admission may skip tokens, through a prefix hit
            assert computed[rid] == 0 and sched.kv.enable_caching and start % BS == 0, (rid, start, computed[rid])
        for g, spec in enumerate(runner.kv_store.specs):
            table = runner.tables[rid][g]
            assert len(table) >= cdiv(end, BS)
            if isinstance(spec, SlidingWindowSpec):
                first_needed = max(0, true_start - spec.sliding_window + 1) // BS
                if not s.device_drafts:  # blocks wholly before the window were handed back
                    assert all(b == 0 for b in table[:first_needed])
                assert all(b != 0 for b in table[first_needed:cdiv(end, BS)])
        computed[rid] = end

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


def apply_result(sched: Scheduler, out: SchedulerOutput, sampled: dict[str, list[int]], computed: dict[str, int],
                 stats: Counter[str]) -> None:
    """update_from_output, checked: the tokens appended, and the rollback of rejected drafts with their blocks."""
    rejected = {s.request_id: s.num_drafts - (len(sampled[s.request_id]) - 1)
                for s in out.scheduled if s.request_id in sampled and s.num_drafts}
    blocks_before = {rid: sum(map(len, sched.kv.get_block_ids(rid))) for rid in rejected}
    for req, appended in sched.update_from_output(out, sampled):
        tokens = sampled[req.request_id]
        assert appended == tokens[:len(appended)] and (appended == tokens or req.is_finished), (appended, tokens)
    for s in out.scheduled:
        rid = s.request_id
        if not rejected.get(rid):
            continue
        # The next step resumes after the accepted drafts (from 0 when preempted meanwhile); a step scheduled
        # ahead of this verdict moves back with it.
        computed[rid] = computed[rid] - rejected[rid] if computed[rid] else 0
        req = sched.requests.get(rid)
        if req is not None and req.status == RequestStatus.RUNNING:
            assert req.num_computed_tokens == computed[rid]
            assert all(len(ids) == cdiv(computed[rid], BS) for ids in sched.kv.get_block_ids(rid))
            stats["trimmed_blocks"] += blocks_before[rid] - sum(map(len, sched.kv.get_block_ids(rid)))


def propose_drafts(sched: Scheduler, rng: random.Random, rate: float) -> None:
    """A fake proposer: for a fraction `rate` of the requests whose last token the host has, 1 to 4 drafts, each
    following the model with probability 0.7."""
    for req in sched.running:
        if req.num_pending_tokens == 0 and rng.random() < rate:
            drafts: list[int] = []
            for _ in range(rng.randint(1, 4)):
                drafts.append(next_token(req.token_ids + drafts) if rng.random() < 0.7 else rng.randrange(V))
            req.spec_token_ids = drafts


def run_workload(seed: int, enable_caching: bool, hybrid: bool, enable_chunked_prefill: bool,
                 async_scheduling: bool | str = False, speculate: bool = False,
                 num_device_drafts: int = 0) -> Counter[str]:
    """async_scheduling: False, True (EngineCore's rule), or "eager": also overlap half the steps where a request
    waits with drafts, so that a step carrying drafts is in flight while the next is scheduled.
    num_device_drafts: k drafts the runner proposes after every sampling step (the device n-gram lookup), so a
    request is scheduled again while its verdict is in flight."""
    rng = random.Random(seed)
    max_model_len = 48
    window = rng.choice([2, 5, 8, 13]) if hybrid else None
    budget = rng.choice([1, 3, 8, 16, 48]) if enable_chunked_prefill else max_model_len + rng.randint(0, 16)
    num_blocks = 1 + cdiv(max_model_len, BS) + rng.randint(0, 10)  # any single request always fits
    sched = make_scheduler(num_blocks=num_blocks, enable_caching=enable_caching, hybrid_window=window,
                           max_num_batched_tokens=budget, max_num_seqs=rng.randint(1, 6),
                           max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                           num_device_drafts=num_device_drafts)
    prefixes = [[rng.randrange(V) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    pending, expected = [], {}
    for i in range(14):
        prompt = rng.choice(prefixes) if rng.random() < 0.6 else []
        prompt = (prompt + [rng.randrange(V) for _ in range(rng.randint(0, 16))])[:max_model_len - 1] or [7]
        max_tokens = rng.randint(1, 20)
        rid = f"req{i}"
        pending.append((rng.randint(0, 30), make_request(rid, prompt, max_tokens)))
        expected[rid] = reference_output(prompt, max_tokens, max_model_len)
    draft_rate = rng.choice([0.1, 0.3, 0.7]) if speculate else 0.0
    runner, computed, stats = FakeRunner(sched, random.Random(seed + 1000)), {}, Counter()
    all_requests, aborted = {}, set()
    # As EngineCore.step: with async scheduling (and no request needing the last step's tokens), step N+1 is
    # scheduled and launched before step N's result is applied; the device computes each step at launch.
    in_flight: tuple[SchedulerOutput, dict[str, list[int]]] | None = None
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
        if not pending and not sched.has_unfinished_requests() and in_flight is None:
            break
        if speculate:
            propose_drafts(sched, rng, draft_rate)
        overlap = bool(async_scheduling) and (not sched.needs_output_history()
                                              or (async_scheduling == "eager" and rng.random() < 0.5))
        if in_flight is not None and not overlap:
            apply_result(sched, *in_flight, computed, stats)
            in_flight = None
        out = sched.schedule()
        check_step(sched, out, runner, computed)
        if out.is_empty:
            assert in_flight is not None or not sched.has_unfinished_requests(), "nothing scheduled"
            if in_flight is not None:
                apply_result(sched, *in_flight, computed, stats)
                in_flight = None
            continue
        sampled = runner.execute(out)
        if not overlap:
            apply_result(sched, out, sampled, computed, stats)
            continue
        if in_flight is not None:
            stats["overlapped"] += 1
            stats["overlapped_drafts"] += any(s.num_drafts for s in in_flight[0].scheduled)
            apply_result(sched, *in_flight, computed, stats)
        in_flight = (out, sampled)
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
    return stats + runner.stats + Counter(preemptions=sched.num_preemptions, prefix_hits=sched.kv.prefix_hits)


@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
@pytest.mark.parametrize("enable_chunked_prefill", [True, False], ids=["chunked", "whole"])
def test_random_workloads_match_the_sequential_model(enable_caching: bool, hybrid: bool,
                                                     enable_chunked_prefill: bool) -> None:
    totals: Counter[str] = Counter()
    for seed in range(12):
        totals += run_workload(seed, enable_caching, hybrid, enable_chunked_prefill)
    # The workloads must exercise what they claim to test.
    assert totals["preemptions"] > 0
    assert (totals["prefix_hits"] > 0) == enable_caching


@pytest.mark.parametrize("async_scheduling", [False, True, "eager"], ids=["sync", "async", "eager"])
@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_random_draft_tokens_roll_back_to_the_sequential_model(enable_caching: bool, hybrid: bool,
                                                               async_scheduling: bool | str) -> None:
    totals: Counter[str] = Counter()
    for seed in range(32):
        totals += run_workload(seed, enable_caching, hybrid, enable_chunked_prefill=seed % 4 != 3,
                               async_scheduling=async_scheduling, speculate=True)
    # Drafts accepted, rejected (rolling back computed tokens and freeing blocks), under preemption and overlap.
    assert totals["accepted"] > 0 and totals["rollbacks"] > 0 and totals["trimmed_blocks"] > 0
    assert totals["preemptions"] > 0
    assert (totals["prefix_hits"] > 0) == enable_caching
    assert (totals["overlapped"] > 0) == bool(async_scheduling)
    # EngineCore's rule runs a step carrying drafts synchronously; "eager" puts one in flight under the next.
    assert (totals["overlapped_drafts"] > 0) == (async_scheduling == "eager")


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_device_drafts_scheduled_ahead_of_their_verdict_match_the_sequential_model(enable_caching: bool,
                                                                                  hybrid: bool, k: int) -> None:
    """Async scheduling with drafts the runner proposes on the device: a request is scheduled for 1 + k more tokens
    while its verdict is in flight, counted as if every draft were accepted; the fake runner starts it where the
    device's history really ends (checked against the host's count less the rejected drafts) and the rollback books
    the difference. Host drafts still come for requests that waited (FakeRunner and the sequential model check)."""
    totals: Counter[str] = Counter()
    for seed in range(24):
        totals += run_workload(seed, enable_caching, hybrid, enable_chunked_prefill=seed % 4 != 3,
                               async_scheduling=True, speculate=True, num_device_drafts=k)
    assert totals["device_drafts"] > 0 and totals["accepted"] > 0 and totals["rollbacks"] > 0
    assert totals["trimmed_blocks"] > 0 and totals["preemptions"] > 0 and totals["overlapped_drafts"] > 0
    assert (totals["prefix_hits"] > 0) == enable_caching
