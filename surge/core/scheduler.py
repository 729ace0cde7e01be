"""Scheduler: each step hands out a token budget to running requests first, then to waiting ones.

There are no prefill or decode phases: a step maps request -> number of new tokens, so chunked prefill, decodes and
prefix-cache hits are one mechanism. When blocks run out, the newest running request is preempted (recompute).
A chunk that touches an image not encoded yet also spends the step's encoder budget (encoder_budget.py); one that
does not fit is cut before that image, and waits for a later step when nothing is left of it.

Progress is booked when a step is scheduled: its tokens count as computed, and a token it samples counts as
pending until its value arrives (update_from_output). So the next step can be scheduled while this one runs.
A request may carry draft tokens (speculative decoding): it is scheduled for 1 + k tokens, and when only j drafts
are accepted its computed tokens roll back and the KV blocks past the new end are freed. With drafts the runner
proposes on the device (n-gram lookup under async scheduling), a request is scheduled again while its verdict is
still in flight: 1 + k more tokens, counted as if every draft were accepted, and the runner starts the row where the
verdict really ended (the rollback then books the difference, as above).

An encoder-only instance (encoder disaggregation) schedules no tokens: each step hands waiting requests' images to
the runner under the encoder budget (one request at least, whatever its size), and a request finishes, with no
output token, in the step that encoded and saved its images.

The scheduler also remembers what the runner holds of each request, so the step message carries only diffs.
"""
from __future__ import annotations

from collections import deque

from surge.config import SchedulerConfig
from surge.core.encoder_budget import EncoderBudget
from surge.core.kv_cache.manager import KVCacheManager
from surge.core.kv_connector import KVConnectorOutput, SchedulerConnector
from surge.core.request import Request, RequestStatus
from surge.core.scheduler_output import EncodeRequest, NewRequest, ScheduledRequest, SchedulerOutput
from surge.core.spec_decode_stats import SpecDecodingStats


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 connector: SchedulerConnector | None = None, num_lookahead_tokens: int = 0,
                 num_device_drafts: int = 0, max_loras: int = 0, encoder_only: bool = False) -> None:
        self.config = config
        # An encoder instance (ec_producer): requests are encoded, never prefilled; those in flight wait here.
        self.encoder_only = encoder_only
        self.encoding: dict[str, Request] = {}
        # LoRA: at most this many distinct adapters among the running requests (so in any step); 0: no LoRA.
        self.max_loras = max_loras
        # k when the runner proposes drafts on the device after every sampling step (surge/spec_decode/ngram.py
        # DeviceNgram): a request may then be scheduled ahead of its verdict (_num_ahead_drafts).
        self.num_device_drafts = num_device_drafts
        # A draft model writes its KV for up to this many positions past a sampling step's end while it proposes
        # (surge/worker/draft_model.py): they get slots too, and are not offered to the prefix cache.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_stats = SpecDecodingStats()
        self.kv = kv_cache_manager
        self.encoder = EncoderBudget(config.max_num_encoder_input_tokens)
        self.connector = connector
        # Requests whose KV an asynchronous connector load is bringing in (blocks allocated, not schedulable yet),
        # and finished ones whose blocks stay held until the connector's save of them is done.
        self.waiting_for_kv: dict[str, Request] = {}
        self._held_for_save: dict[str, Request] = {}
        self.num_failed_kv_loads = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self._removed_loras: list[int] = []  # unloaded adapters, for the runners once no request uses them
        # Request id -> how many of its tokens the model runner holds (it holds every request it was sent until
        # told the request finished); the KV cache manager tracks the block tables' changes likewise.
        self._runner_tokens: dict[str, int] = {}

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv or self._held_for_save or self.encoding)

    def has_connector_work(self) -> bool:
        """True when a step must run for the connector alone: loads in flight, saves to hear back from."""
        return self.connector is not None and bool(self.waiting_for_kv or self._held_for_save
                                                   or self.connector.has_pending_work())

    def schedule(self) -> SchedulerOutput:
        if self.encoder_only:
            return self._schedule_encoding()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        ahead: dict[str, int] = {}  # request id -> device drafts of a step scheduled ahead of its verdict
        self.encoder.begin_step()

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_ahead = self._num_ahead_drafts(req)
            if num_ahead and num_ahead + 1 > budget:  # the tokens it would verify do not fit: decode its one
                num_ahead = -1 if req.num_spec_in_flight else 0  # pending token, or wait for the verdict
            if num_ahead < 0 or (req.num_pending_tokens and not num_ahead
                                 and (self._ends_with_pending(req) or req.num_spec_in_flight)):
                # Its last token is on its way and ends it, or drafts in flight decide where it resumes.
                i += 1
                continue
            if req.params.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:
                i += 1  # the prompt only (scoring): its last chunk is in flight, and that step finishes it
                continue
            if num_ahead:
                num_new = 1 + num_ahead
            else:
                num_spec = self._num_spec_tokens(req)
                num_new = min(req.num_tokens_with_pending - req.num_computed_tokens + num_spec, budget)
                num_new = self._whole_images(req, req.num_computed_tokens, num_new)
                if num_new and req.mm_features:
                    num_new = self.encoder.fit(req, req.num_computed_tokens, num_new)
                if not num_new:  # its next image waits: for room for all of it, or for encoder budget
                    i += 1
                    continue
            assert num_new > 0
            lookahead = self._num_lookahead(req.num_computed_tokens + num_new, req.num_tokens_with_pending)
            # Drafts in flight may still roll the computed tokens back: sliding windows keep blocks for that.
            while not self.kv.allocate_slots(req, num_new + lookahead, num_unready_tokens=lookahead,
                                             num_uncertain_tokens=req.num_spec_in_flight):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = num_new
                if req.mm_features:
                    self.encoder.commit(req, req.num_computed_tokens, num_new)
                if num_ahead:
                    ahead[req.request_id] = num_ahead
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing after it remains

        # 2. Waiting requests, in arrival order (preempted ones were put back at the front). One whose adapter would
        # exceed max_loras distinct adapters among the running waits, without holding up those behind it.
        skipped: list[Request] = []
        adapters = self._running_adapters() if self.max_loras else set()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if out.preempted_ids:
                break  # memory is tight this step; admitting more would only thrash
            req = self.waiting[0]
            lora = req.lora_request
            if lora is not None and lora.lora_int_id not in adapters and len(adapters) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if req.num_pending_tokens:
                break  # preempted while a step computing its next token is in flight: resume once it arrives
            hit, num_hit = ([], 0)
            num_external, load_async = 0, False
            if req.num_computed_tokens == 0:
                hit, num_hit = self.kv.get_computed_blocks(req)
                if self.connector is not None and not req.skip_kv_connector:
                    num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_hit)
                    num_external = max(0, min(num_external, req.num_tokens - 1 - num_hit))
            num_new = req.num_tokens - req.num_computed_tokens - num_hit - num_external
            if load_async:
                num_new = 0  # computed once the load is in
            elif not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            start = req.num_computed_tokens + num_hit + num_external
            if not load_async:
                num_new = self._whole_images(req, start, num_new)
                if not num_new:
                    break  # its next image waits for a step with room for all of it
            if req.mm_features and not load_async:
                whole = not self.config.enable_chunked_prefill
                fitted = self.encoder.fit(req, start, num_new, whole)
                if not fitted or (fitted < num_new and whole):
                    break  # the encoder budget is spent this step; it goes first next step
                num_new = fitted
            lookahead = self._num_lookahead(start + num_new, req.num_tokens)
            if not self.kv.allocate_slots(req, num_external + num_new + lookahead, hit, num_hit,
                                          num_unready_tokens=(num_external if load_async else 0) + lookahead):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit + num_external
                req.num_external_cached_tokens = num_external
            req.num_computed_tokens += num_hit
            if num_external:
                self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), num_external)
            if load_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                req.num_external_pending = num_external
                self.waiting_for_kv[req.request_id] = req
                continue
            req.num_computed_tokens += num_external
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.mm_features:
                self.encoder.commit(req, start, num_new)
            if lora is not None:
                adapters.add(lora.lora_int_id)
            scheduled[req.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        self.encoder.end_step()

        for req in self.running:
            num_new = scheduled.get(req.request_id)
            if num_new is None:
                continue
            end = req.num_computed_tokens + num_new
            num_ahead = ahead.get(req.request_id, 0)
            samples = (end >= req.num_tokens_with_pending and req.params.max_tokens != 0) or bool(num_ahead)
            spec = req.spec_token_ids[:end - req.num_tokens_with_pending] if samples and not num_ahead else []
            out.scheduled.append(self._scheduled_entry(req, num_new, samples, spec, out, num_ahead))
            req.num_computed_tokens += num_new
            req.num_pending_tokens += samples
            req.num_spec_in_flight += len(spec) + num_ahead
            req.spec_token_ids = []  # proposed anew after the verdict
        if out.scheduled or self.has_connector_work():  # an output that is not executed would lose them
            out.finished_ids, self._finished_ids = self._finished_ids, []
            if self._removed_loras:
                out.removed_lora_ids = self._take_removed_loras()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _schedule_encoding(self) -> SchedulerOutput:
        """An encoder instance's step: waiting requests, in arrival order, while their images fit the encoder budget
        (the first whatever its size), to be encoded and saved; a request without images finishes at once."""
        out = SchedulerOutput()
        remaining = self.config.max_num_encoder_input_tokens
        while self.waiting and len(self.encoding) < self.config.max_num_seqs:
            req = self.waiting[0]
            cost = sum({f.identifier: f.length for f in req.mm_features}.values())
            if out.encode_only and cost > remaining:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.encoding[req.request_id] = req
            out.encode_only.append(EncodeRequest(req.request_id, req.mm_features))
            remaining -= cost
        return out

    def remove_lora(self, lora_int_id: int) -> None:
        """The server unloaded this adapter: the runners free its slot and host copy once no request uses it (one
        still running keeps it until it finishes)."""
        if lora_int_id not in self._removed_loras:
            self._removed_loras.append(lora_int_id)

    def _take_removed_loras(self) -> list[int]:
        in_use = {r.lora_request.lora_int_id for r in self.requests.values() if r.lora_request is not None}
        free = [i for i in self._removed_loras if i not in in_use]
        self._removed_loras = [i for i in self._removed_loras if i in in_use]
        return free

    def _running_adapters(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _whole_images(self, req: Request, start: int, num_new: int) -> int:
        """num_new, or under disable_chunked_mm_input fewer: the chunk [start, start + num_new) stops before an image
        it would end inside (0 when it starts inside one: after a prefix-cache hit, the rest of that image)."""
        if not self.config.disable_chunked_mm_input:
            return num_new
        end = start + num_new
        for f in req.mm_features:
            if f.offset < end < f.end:
                return max(0, f.offset - start)
        return num_new

    def _num_lookahead(self, end: int, num_tokens: int) -> int:
        """Slots past a step's end for the draft model's proposals: only when the step samples, within
        max_model_len."""
        if not self.num_lookahead_tokens or end < num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.config.max_model_len - end))

    def _num_ahead_drafts(self, req: Request) -> int:
        """k for a request whose sampling step is in flight when it can be scheduled ahead of it, verifying the k
        drafts the runner proposes on the device after that step; 0 when it must wait for the host (its sampling
        reads earlier tokens: penalties, a grammar, an unmet min_tokens holding back a stop token; or the step in
        flight may end it by length), or when k more drafts could pass max_model_len."""
        k, p = self.num_device_drafts, req.params
        if not k or req.num_pending_tokens != 1:
            return 0
        if p.uses_penalties or p.structured_outputs is not None:
            return 0
        if req.num_output_tokens < p.min_tokens and p.all_stop_token_ids:  # its mask counts outputs the host lacks
            return 0
        most = req.num_output_tokens + 1 + req.num_spec_in_flight  # outputs once the step in flight is in
        if p.max_tokens is not None and most >= p.max_tokens:
            return 0
        # Counted as accepted, the step in flight ends the known tokens at num_computed_tokens + 1; this one
        # computes 1 + k from there and may yield k + 1 tokens.
        if req.num_computed_tokens + k + 2 > self.config.max_model_len:
            return 0
        return k

    def _num_spec_tokens(self, req: Request) -> int:
        """Drafts to verify this step: only after the whole known sequence, and never past max_model_len."""
        if not req.spec_token_ids or req.num_pending_tokens or req.num_computed_tokens + 1 != req.num_tokens:
            return 0
        return max(0, min(len(req.spec_token_ids), self.config.max_model_len - 1 - req.num_tokens))

    def _scheduled_entry(self, req: Request, num_new: int, samples: bool, spec: list[int],
                         out: SchedulerOutput, num_ahead: int = 0) -> ScheduledRequest:
        """The step's entry for req as a diff against what the runner holds (a NewRequest the first time)."""
        rid = req.request_id
        known = self._runner_tokens.get(rid)
        if known is None:
            out.new_requests.append(NewRequest(rid, req.prompt_token_ids, req.params, req.pooling_params,
                                               req.lora_request, req.mm_features))
            known = req.num_prompt_tokens
        self._runner_tokens[rid] = req.num_tokens
        starts, block_ids = self.kv.take_block_changes(rid)
        return ScheduledRequest(rid, req.num_computed_tokens, num_new, samples, req.token_ids[known:], starts,
                                block_ids, spec, num_ahead)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)  # the runner keeps the request (and its RNG); its block table is sent again from 0
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
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
        """True when a running request's next step depends on the tokens of the one before: its sampling reads them
        (penalties), or it carries draft tokens proposed on the host (after, and verified against, its last token;
        with device drafts a request that carries host ones has no step in flight, so nothing waits for one)."""
        return any(r.params.uses_penalties or (r.spec_token_ids and not self.num_device_drafts)
                   for r in self.running)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           kv_output: KVConnectorOutput | None = None) -> list[tuple[Request, list[int]]]:
        """Append each request's new tokens (1 + the accepted drafts), stopping at the first that ends it; roll back
        the rejected drafts' computed tokens and free the KV blocks past the new end; take in the connector's
        finished loads and saves. Returns (request, tokens appended) for every request that received tokens."""
        if kv_output is not None:
            self._update_from_connector(kv_output)
        progressed = []
        for e in out.encode_only:  # encoded and saved: done, with no token
            req = self.requests.get(e.request_id)
            if req is not None:
                self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
                progressed.append((req, []))
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:
                continue  # finished (stopped, aborted) while this step was in flight: its tokens are dropped
            req.num_pending_tokens -= s.samples
            num_drafts = s.num_drafts
            req.num_spec_in_flight -= num_drafts  # an older step's result leaves later drafts in flight
            tokens = sampled.get(s.request_id)
            if not tokens:
                if req.params.max_tokens == 0 and s.num_computed_tokens + s.num_new_tokens >= req.num_tokens:
                    # The prompt only: done (a pooling request's pooled output came with this step).
                    self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH if req.pooling_params is None
                                        else RequestStatus.FINISHED_STOPPED)
                    progressed.append((req, []))
                continue  # a prefill chunk that did not reach the end yet
            num_rejected = num_drafts - (len(tokens) - 1)
            assert num_rejected >= 0, (s.request_id, s.spec_token_ids, s.device_drafts, tokens)
            if num_drafts:  # the verdict as verified, before a stop cuts the run
                self.spec_stats.observe(num_drafts, len(tokens) - 1)
            if num_rejected and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens -= num_rejected
                self.kv.trim(req, req.num_computed_tokens)
            appended = []
            for token in tokens:
                req.append_token(token)
                appended.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    self.finish_request(req.request_id, status)
                    break
            progressed.append((req, appended))
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

    def _update_from_connector(self, kv_output: KVConnectorOutput) -> None:
        """Loads that arrived count as computed (the request becomes schedulable); a failed or partial one is
        recomputed from its local prefix, and counted; a finished save frees the blocks it held."""
        failed = set(kv_output.failed_recving)
        for rid in [*kv_output.finished_recving, *kv_output.failed_recving]:
            req = self.waiting_for_kv.pop(rid, None)
            if req is None:
                continue
            num_external, req.num_external_pending = req.num_external_pending, 0
            if req.is_finished:  # aborted while its load ran: only now may its blocks go back
                self.kv.free(req)
                continue
            if rid in failed:  # start over without the connector: the blocks may hold part of the load
                self.num_failed_kv_loads += 1
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.num_cached_tokens = -1
                req.num_external_cached_tokens = 0
                req.skip_kv_connector = True
            else:
                req.num_computed_tokens += num_external
                self.kv.cache_blocks(req, req.num_computed_tokens)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        for rid in kv_output.finished_sending:
            req = self._held_for_save.pop(rid, None)
            if req is not None:
                self.kv.free(req)
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish (stop string found by the detokenizer) or abort a request, running or waiting."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if self.encoding.pop(request_id, None) is not None:
            req.status = status
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if request_id in self.waiting_for_kv:  # a load still writes its blocks: they are freed when it ends
            req.status = status
            self._runner_tokens.pop(request_id, None)
            return
        hold = False
        if self.connector is not None:
            hold, req.kv_transfer_params = self.connector.request_finished(req, self.kv.get_block_ids(request_id))
        if hold:
            self._held_for_save[request_id] = req
        else:
            self.kv.free(req)
        if req.mm_features:
            self.encoder.finish(req)
        req.status = status
        if self._runner_tokens.pop(request_id, None) is not None:  # the runner holds it: tell it to let go
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
