"""OutputProcessor: the front end's view of requests. Turns EngineCoreOutputs into RequestOutputs: detokenizes
incrementally, finds stop strings, builds logprob dicts, gathers the n samples of a request together, and
measures what the metrics report: per token (time to first token, inter-token) and per finished request (its
phases, token counts and parameters).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from surge.engine.core import EngineCoreOutput
from surge.engine.detokenizer import IncrementalDetokenizer, decode_token
import torch

from surge.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from surge.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # each output holds everything so far (surge.LLM)
    DELTA = "delta"  # only what is new since the previous output (streaming)
    FINAL_ONLY = "final_only"  # one output, once finished


@dataclass
class FinishedRequestStats:
    """One finished request (all n of its samples), in vLLM's terms: queued (waiting in the core) -> prefill (first
    scheduled until its first token) -> decode (first token until its last); inference is prefill + decode."""
    finish_reason: str  # "abort" if a sample was aborted, else "length" if one was cut, else "stop"
    e2e_latency: float  # arrival at the front end until finished
    queued_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    num_prompt_tokens: int
    num_generation_tokens: int  # all samples together
    max_num_generation_tokens: int  # the longest sample
    mean_time_per_output_token: float  # decode time per token after the first, averaged over the samples
    n: int
    max_tokens: int | None


@dataclass
class IterationStats:
    """What one batch of engine outputs did, for metrics."""
    num_prompt_tokens: int = 0  # prompts of requests whose first token arrived (or that finished without one)
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class SampleState:
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_emitted_tokens: int = 0  # DELTA outputs: tokens already handed out
    finish_emitted: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    timestamps: tuple[float, float] | None = None  # the core's (queued, first scheduled)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[str, SampleState]  # child request id -> state
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    output_kind: OutputKind = OutputKind.CUMULATIVE
    arrival_time: float = 0.0
    first_token_time: float | None = None
    kv_transfer_params: dict | None = None
    pooling: bool = False  # a pooling request: one PoolingRequestOutput once finished
    pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    children: list[tuple[str, SamplingParams]], output_kind: OutputKind = OutputKind.CUMULATIVE,
                    arrival_time: float | None = None, pooling: bool = False) -> None:
        samples = {}
        for index, (child_id, params) in enumerate(children):
            samples[child_id] = SampleState(index, params,
                                            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                                            logprobs=[] if params.logprobs is not None else None,
                                            cumulative_logprob=0.0 if params.logprobs is not None else None)
            self.child_to_parent[child_id] = request_id
        want_prompt_lp = children[0][1].prompt_logprobs is not None
        self.parents[request_id] = ParentState(
            request_id, prompt, list(prompt_token_ids), samples,
            prompt_logprobs=[None] if want_prompt_lp else None, output_kind=output_kind,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time, pooling=pooling)

    def process(self, outputs: list[EngineCoreOutput],
                stats: IterationStats | None = None) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated RequestOutputs and the child ids the core must stop (a stop string matched).
        Latencies and token counts go into `stats` when given."""
        touched: dict[str, ParentState] = {}
        to_stop = []
        now = time.monotonic()
        for o in outputs:
            parent_id = self.child_to_parent.get(o.request_id)
            if parent_id is None:
                continue  # aborted meanwhile
            parent = self.parents[parent_id]
            sample = parent.samples[o.request_id]
            if sample.finish_reason is not None:
                continue  # stopped by a stop string; the core sent this before it learned so
            if o.timestamps is not None:
                sample.timestamps = o.timestamps
            if stats is not None and o.new_token_ids:
                self._record_token_times(parent, sample, len(o.new_token_ids), now, stats)
            parent.num_cached_tokens = max(parent.num_cached_tokens, o.num_cached_tokens)
            if o.kv_transfer_params is not None:
                parent.kv_transfer_params = o.kv_transfer_params
            if o.pooling_output is not None:
                parent.pooling_output = o.pooling_output
            if o.prompt_logprobs is not None and parent.prompt_logprobs is not None and sample.index == 0:
                self._add_prompt_logprobs(parent, o.prompt_logprobs)
            # Several tokens (accepted drafts) go in one at a time: a stop string one of them completes ends the
            # output there, exactly as if they had come one per step.
            for j, token in enumerate(o.new_token_ids):
                sample.token_ids.append(token)
                if o.logprobs is not None and sample.logprobs is not None:
                    ids, lps, rank = o.logprobs[j]
                    sample.logprobs.append(self._logprob_dict(ids, lps, rank))
                    sample.cumulative_logprob += lps[0]
                stop_str = sample.detokenizer.update([token] if len(o.new_token_ids) > 1 else o.new_token_ids)
                if stop_str is not None and (o.finish_reason is None or j < len(o.new_token_ids) - 1):
                    sample.finish_reason, sample.stop_reason = "stop", stop_str
                    to_stop.append(o.request_id)
                    break
            if o.finish_reason is not None and sample.finish_reason is None:
                sample.finish_reason, sample.stop_reason = o.finish_reason, o.stop_reason
            touched[parent_id] = parent
        results = []
        for p in touched.values():
            out = self._make_output(p)
            if out is not None:
                results.append(out)
            if p.finished:
                self._forget(p)
                if stats is not None:
                    if p.first_token_time is None:  # the prompt only (max_tokens=0): it counts as it ends
                        stats.num_prompt_tokens += len(p.prompt_token_ids)
                    stats.finished_requests.append(_finished_stats(p, now))
        return results, to_stop

    def fail(self, child_id: str) -> tuple[str, list[str]] | None:
        """A child request failed in the engine: forget its parent; returns (parent id, the other child ids
        for the core to abort), or None when the parent is already gone."""
        parent_id = self.child_to_parent.get(child_id)
        if parent_id is None:
            return None
        return parent_id, [c for c in self.abort(parent_id) if c != child_id]

    @staticmethod
    def _record_token_times(parent: ParentState, sample: SampleState, num_new: int, now: float,
                            stats: IterationStats) -> None:
        stats.num_generation_tokens += num_new
        if parent.first_token_time is None:
            parent.first_token_time = now
            stats.time_to_first_token.append(now - parent.arrival_time)
            stats.num_prompt_tokens += len(parent.prompt_token_ids)
        elif sample.last_token_time is not None:
            stats.inter_token_latency.append(now - sample.last_token_time)
        if sample.first_token_time is None:
            sample.first_token_time = now
        sample.last_token_time = now

    def abort(self, request_id: str) -> list[str]:
        """Forget a parent request; returns its child ids for the core to abort."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        self._forget(parent)
        return list(parent.samples)

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def _forget(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for child_id in parent.samples:
            self.child_to_parent.pop(child_id, None)

    def _logprob_dict(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        d = {ids[0]: Logprob(lps[0], rank, decode_token(self.tokenizer, ids[0]))}
        for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            if tid not in d:
                d[tid] = Logprob(lp, r, decode_token(self.tokenizer, tid))
        return d

    def _add_prompt_logprobs(self, parent: ParentState, data) -> None:
        first, ids, lps, ranks = data
        assert len(parent.prompt_logprobs) == first + 1, "prompt logprobs arrive in order"
        for row_ids, row_lps, rank in zip(ids, lps, ranks):
            parent.prompt_logprobs.append(self._logprob_dict(row_ids, row_lps, rank))

    def _make_output(self, parent: ParentState) -> RequestOutput | PoolingRequestOutput | None:
        if parent.pooling:
            if not parent.finished or parent.pooling_output is None:
                return None
            return PoolingRequestOutput(parent.request_id, PoolingOutput(torch.tensor(parent.pooling_output)),
                                        parent.prompt_token_ids, True, parent.num_cached_tokens)
        kind = parent.output_kind
        if kind == OutputKind.FINAL_ONLY and not parent.finished:
            return None
        outs = []
        for s in sorted(parent.samples.values(), key=lambda s: s.index):
            if kind == OutputKind.DELTA:
                out = self._delta(s)
                if out is not None:
                    outs.append(out)
                continue
            outs.append(CompletionOutput(
                index=s.index, text=s.detokenizer.output_text, token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        if not outs:
            return None
        return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                             prompt_token_ids=parent.prompt_token_ids, outputs=outs, finished=parent.finished,
                             prompt_logprobs=parent.prompt_logprobs, num_cached_tokens=parent.num_cached_tokens,
                             kv_transfer_params=parent.kv_transfer_params)

    @staticmethod
    def _delta(s: SampleState) -> CompletionOutput | None:
        """What is new in a sample since its previous DELTA output; None when nothing is (and no finish to tell)."""
        finished = s.finish_reason is not None
        text = s.detokenizer.get_next_delta(finished)
        start = s.num_emitted_tokens
        s.num_emitted_tokens = len(s.token_ids)
        if not text and start == len(s.token_ids) and (not finished or s.finish_emitted):
            return None
        s.finish_emitted = finished
        return CompletionOutput(index=s.index, text=text, token_ids=s.token_ids[start:],
                                cumulative_logprob=s.cumulative_logprob,
                                logprobs=s.logprobs[start:] if s.logprobs is not None else None,
                                finish_reason=s.finish_reason, stop_reason=s.stop_reason)


def _finished_stats(parent: ParentState, now: float) -> FinishedRequestStats:
    samples = list(parent.samples.values())
    reasons = {s.finish_reason for s in samples}
    reason = "abort" if "abort" in reasons else "length" if "length" in reasons else "stop"
    stamps = [s.timestamps for s in samples if s.timestamps is not None]
    queued = min((q for q, _ in stamps), default=parent.arrival_time)
    scheduled = min((t for _, t in stamps), default=queued)
    first = parent.first_token_time if parent.first_token_time is not None else now  # no token: prefill to the end
    last = max((s.last_token_time for s in samples if s.last_token_time is not None), default=first)
    tpot = [(s.last_token_time - s.first_token_time) / (len(s.token_ids) - 1) for s in samples
            if len(s.token_ids) > 1 and s.first_token_time is not None]
    return FinishedRequestStats(
        finish_reason=reason, e2e_latency=now - parent.arrival_time, queued_time=max(scheduled - queued, 0.0),
        prefill_time=max(first - scheduled, 0.0), decode_time=last - first, inference_time=max(last - scheduled, 0.0),
        num_prompt_tokens=len(parent.prompt_token_ids), num_generation_tokens=sum(len(s.token_ids) for s in samples),
        max_num_generation_tokens=max(len(s.token_ids) for s in samples),
        mean_time_per_output_token=sum(tpot) / len(tpot) if tpot else 0.0, n=len(samples),
        max_tokens=samples[0].params.max_tokens)
