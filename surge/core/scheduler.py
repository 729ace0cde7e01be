"""Scheduler: each step hands out a token budget to running requests first, then to waiting ones.

There are no prefill or decode phases: a step maps request -> number of new tokens, so chunked prefill, decodes and
prefix-cache hits are one mechanism. When blocks run out, the newest running request is preempted (recompute).

Progress is booked when a step is scheduled: its tokens count as computed, and a token it samples counts as
pending until its value arrives (update_from_output). So the next step can be scheduled while this one runs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from surge.config import SchedulerConfig
from surge.core.kv_cache.manager import KVCacheManager
from surge.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    block_ids: tuple[list[int], ...]  # per KV cache group
    # True when this step reaches the end of the request's tokens (pending ones included), so its last position
    # yields a new token.
    samples: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Requests finished since the last non-empty step: worker processes drop what they cached for them.
    finished_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending_tokens and self._ends_with_pending(req):
                i += 1  # its last token is on its way: nothing more to compute
                continue
            num_new = min(req.num_tokens_with_pending - req.num_computed_tokens, budget)
            assert num_new > 0
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = num_new
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing after it remains

        # 2. Waiting requests, in arrival order (preempted ones were put back at the front).
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if out.preempted_ids:
                break  # memory is tight this step; admitting more would only thrash
            req = self.waiting[0]
            if req.num_pending_tokens:
                break  # preempted while a step computing its next token is in flight: resume once it arrives
            hit, num_hit = ([], 0)
            if req.num_computed_tokens == 0:
                hit, num_hit = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - req.num_computed_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(req, num_new, hit, num_hit):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = num_new
            budget -= num_new

        for req in self.running:
            num_new = scheduled.get(req.request_id)
            if num_new is None:
                continue
            samples = req.num_computed_tokens + num_new == req.num_tokens_with_pending
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new,
                                                  self.kv.get_block_ids(req.request_id), samples))
            req.num_computed_tokens += num_new
            req.num_pending_tokens += samples
        if out.scheduled:  # an empty output is never executed, so it would lose them
            out.finished_ids, self._finished_ids = self._finished_ids, []
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _ends_with_pending(self, req: Request) -> bool:
        """True when the pending tokens already reach a length limit, so the request will finish with them."""
        max_tokens = req.params.max_tokens
        if max_tokens is not None and req.num_output_tokens + req.num_pending_tokens >= max_tokens:
            return True
        return req.num_tokens_with_pending >= self.config.max_model_len

    def needs_output_history(self) -> bool:
        """True when a running request's sampling reads its previous tokens (penalties): its next step must wait
        for the tokens of the one before."""
        return any(r.params.uses_penalties for r in self.running)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append the step's sampled tokens, finish requests that hit a stop condition or a length limit.
        Returns the requests that received a token this step."""
        progressed = []
        for s in out.scheduled:
            req = s.request
            req.num_pending_tokens -= s.samples
            if req.is_finished:
                continue  # finished (stopped, aborted) while this step was in flight: its token is dropped
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end yet
            req.append_token(token)
            progressed.append(req)
            status = self._check_stop(req, token)
            if status is not None:
                self.finish_request(req.request_id, status)
        return progressed

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.params
        if req.num_output_tokens >= params.min_tokens and token in params.all_stop_token_ids:
            req.stop_reason = token if token in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish (stop string found by the detokenizer) or abort a request, running or waiting."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        self._finished_ids.append(request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.finish_request(rid, RequestStatus.FINISHED_ABORTED)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
