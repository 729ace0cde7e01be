"""EngineCore: the busy loop's body. Each step schedules, executes the model and updates request state,
returning per-request outputs (token ids and logprobs; text is the front end's job).

`surge.LLM` drives it in-process; the server drives the same class in its own process (engine/core_proc.py).
"""
from __future__ import annotations

import time

import msgspec
import torch

from surge.config import EngineConfig
from surge.core.kv_cache.manager import KVCacheManager
from surge.core.request import Request, RequestStatus
from surge.core.scheduler import Scheduler
from surge.core.scheduler_output import SchedulerOutput
from surge.distributed.lifecycle import freeze_startup_objects, unfreeze_objects
from surge.engine.input_processor import load_tokenizer
from surge.kv_transfer.base import KVConnectorRole
from surge.kv_transfer.factory import create_connector
from surge.spec_decode.ngram import NgramProposer
from surge.structured_output.manager import StructuredOutputManager
from surge.structured_output.reasoning import REASONING_MARKERS
from surge.logger import init_logger
from surge.worker.executor import StepHandle, create_executor
from surge.worker.model_runner import ModelRunnerOutput

logger = init_logger(__name__)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Per new token: (ids, logprobs, sampled rank); ids[0] is the sampled token.
    logprobs: list[tuple[list[int], list[float], int]] | None = None
    # (first prompt position, ids, logprobs, ranks) for the prompt positions computed this step.
    prompt_logprobs: tuple[int, list[list[int]], list[list[float]], list[int]] | None = None
    # With a request's first output: (queued, first scheduled) in time.monotonic(), which the front end on this host
    # shares; its queue and prefill time metrics start there.
    timestamps: tuple[float, float] | None = None
    kv_transfer_params: dict | None = None  # a finished request's, from the KV connector (prefill -> decode)
    pooling_output: list[float] | None = None  # a pooling request's embedding or class probabilities, as it ends


class SchedulerStats(msgspec.Struct, array_like=True):
    """The core's load after a step, for metrics: gauges, and counters that only grow."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # share of KV blocks in use, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    # The KV connector's (zero without one): prompt tokens it supplied, bytes and seconds moved, failed loads,
    # share of its own storage in use.
    kv_external_queries: int = 0  # prompt tokens the connector was asked about
    kv_external_hit_tokens: int = 0
    kv_loaded_bytes: int = 0
    kv_saved_bytes: int = 0
    kv_load_seconds: float = 0.0
    kv_save_seconds: float = 0.0
    kv_failures: int = 0
    kv_storage_usage: float = 0.0
    # Speculative decoding's running totals (surge/core/spec_decode_stats.py), zero without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # Encoder disaggregation (zero without an EC connector): images whose embeddings were loaded from the encoder
    # instance, saved for a prefill instance (an encoder instance's), and encoded here because the encoder
    # instance's were not there (it is down, failed, or the request did not pass it).
    ec_loaded_images: int = 0
    ec_saved_images: int = 0
    encoder_fallbacks: int = 0
    # LoRA: the adapters of the running and of the waiting requests, by name (vLLM's lora_requests_info labels).
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        # One rank in this process, or worker ranks in their own: the same contract, async scheduling in both.
        self.executor = create_executor(config)
        self.kv_cache_manager = KVCacheManager(self.executor.kv_cache_config,
                                               config.cache_config.enable_prefix_caching)
        # The scheduler half of the KV connector, if any (each worker rank holds the other half).
        self.kv_connector = create_connector(config, KVConnectorRole.SCHEDULER, self.executor.kv_cache_config)
        sc = config.speculative_config
        self.async_scheduling = config.scheduler_config.async_scheduling
        # n-gram drafts: under async scheduling the runner looks them up on the device after every sampling step
        # (a request's next step is then launched before its verdict is back); else here, after the verdict. A
        # draft model's are on the device either way: under async scheduling its steps are launched ahead too.
        device_ngram = sc is not None and sc.method == "ngram" and self.async_scheduling
        device_drafts = sc is not None and self.async_scheduling
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, self.kv_connector,
                                   num_lookahead_tokens=sc.num_lookahead_tokens if sc is not None else 0,
                                   num_device_drafts=sc.num_speculative_tokens if device_drafts else 0,
                                   max_loras=config.lora_config.max_loras if config.lora_config else 0,
                                   encoder_only=config.ec_transfer_config is not None
                                   and config.ec_transfer_config.encoder_only)
        # Encoder disaggregation's counters, summed from the runner's step outputs.
        self.ec_loaded = self.ec_saved = self.encoder_fallbacks = 0
        # Host n-gram drafts are looked up here; a draft model's, and device ones, come with each step's output.
        self.proposer = NgramProposer(sc) if sc is not None and sc.method == "ngram" and not device_ngram else None
        self.speculates = sc is not None
        self.structured_output = _structured_output_manager(config)
        # In-process runner: it asks for the step's masks after launching the forward, so they are filled (and the
        # token in flight awaited) while the device runs it. Worker ranks get them in the step message instead.
        # The step before, when the masks awaited it: its outputs processed while they were filled (in-process), or
        # the step itself, processed once this one is launched (worker ranks).
        self._previous_outputs: list[EngineCoreOutput] | None = None
        self._previous: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        runner = getattr(self.executor, "runner", None)
        self._masks_deferred = runner is not None
        if runner is not None:
            runner.grammar_bitmask_source = self._grammar_bitmask
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self._first_scheduled: dict[str, float] = {}  # request id -> when first scheduled, until its first output
        kvc = self.executor.kv_cache_config
        self.max_tokens_in_kv = (kvc.num_blocks - 1) * config.cache_config.block_size
        # Start-up's objects leave the garbage collector's view at the step after the first output: the collection
        # before the freeze (~0.07 s at 8B on the H200) would otherwise stand between a restart and its first token.
        self._freeze: str | None = "after output"  # -> "now" -> None (done)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and run one step; returns the outputs of the step that finished. With async scheduling that is
        the step before: this one is launched first, so the host's work for it overlaps the device's for that one."""
        if self._freeze == "now":
            freeze_startup_objects()
            self._freeze = None
        outputs = self._step()
        if outputs and self._freeze is not None:
            self._freeze = "now"
        return outputs

    def add_request(self, request: Request) -> None:
        max_len = self.config.scheduler_config.max_model_len
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if request.pooling_params is not None and request.num_prompt_tokens > max_len:
            raise ValueError(f"the prompt has {request.num_prompt_tokens} tokens, more than max_model_len={max_len}")
        if request.pooling_params is None and request.num_prompt_tokens >= max_len:
            raise ValueError(f"the prompt has {request.num_prompt_tokens} tokens, which leaves no room to generate "
                             f"within max_model_len={max_len}")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        grammar = self.structured_output.compile(request.prompt_token_ids, request.params)  # ValueError if rejected
        self.scheduler.add_request(request)
        if grammar is not None:
            self.structured_output.add(request.request_id, grammar)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        self.structured_output.remove(request_ids)
        for rid in request_ids:
            self._first_scheduled.pop(rid, None)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for rid in request_ids:
            self.scheduler.finish_request(rid, status)
        self.structured_output.remove(request_ids)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (the server unloaded it): the workers free its slot before their next step that no
        longer needs it, so a later load, under any name, reads its files afresh."""
        if self.config.lora_config is None:
            return False
        self.scheduler.remove_lora(lora_int_id)
        return True

    def shutdown(self) -> None:
        """Stop worker ranks, if any (also done at exit, or when the engine is collected), and the connector; give
        the engine's objects back to the garbage collector."""
        self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        unfreeze_objects()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def request_ids(self) -> list[str]:
        """Every request not finished yet, waiting or running."""
        return list(self.scheduler.requests)

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        stats = SchedulerStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                               kv_cache_usage=kv.usage, prefix_cache_queries=kv.prefix_queries,
                               prefix_cache_hits=kv.prefix_hits, num_preemptions=self.scheduler.num_preemptions)
        if self.kv_connector is not None:
            c = self.kv_connector.stats
            stats.kv_external_queries, stats.kv_external_hit_tokens = c.external_queried_tokens, c.external_hit_tokens
            stats.kv_loaded_bytes, stats.kv_saved_bytes = c.loaded_bytes, c.saved_bytes
            stats.kv_load_seconds, stats.kv_save_seconds, stats.kv_storage_usage = (
                c.load_seconds, c.save_seconds, c.pool_usage)
            stats.kv_failures = c.failures  # failed or partial loads (recomputed) and store errors
        stats.ec_loaded_images, stats.ec_saved_images = self.ec_loaded, self.ec_saved
        stats.encoder_fallbacks = self.encoder_fallbacks
        if self.config.lora_config is not None:
            stats.running_lora_adapters = _adapter_names(self.scheduler.running)
            stats.waiting_lora_adapters = _adapter_names(self.scheduler.waiting)
        if self.speculates:
            sd = self.scheduler.spec_stats
            stats.spec_num_drafts, stats.spec_num_draft_tokens = sd.num_drafts, sd.num_draft_tokens
            stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos = sd.num_accepted_tokens, \
                list(sd.accepted_per_pos)
        return stats

    def _step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        # Speculation steps synchronously unless its drafts are looked up on the device: host drafts come after a
        # request's last token, which is never on the host while a step is in flight (the H200 run proposed nothing
        # under async scheduling before the device n-gram lookup).
        overlap = (self.async_scheduling and not self.scheduler.needs_output_history()
                   and (self.config.speculative_config is None or self.scheduler.num_device_drafts > 0))
        if self._in_flight is not None and not overlap:
            outputs = self._finish_in_flight()
        sched_out = self.scheduler.schedule()
        for new in sched_out.new_requests:
            self._first_scheduled[new.request_id] = time.monotonic()
        if sched_out.is_empty:
            if self._in_flight is not None:
                return outputs + self._finish_in_flight()
            if self.scheduler.has_connector_work():  # a step for the connector alone: start loads, hear back
                result = self._execute(sched_out)
                if not result.kv_connector_output or not (result.kv_connector_output.finished_recving
                                                          or result.kv_connector_output.finished_sending):
                    time.sleep(0.001)  # nothing arrived: do not spin the host while a load runs
                return outputs + self._process(sched_out, result)
            if not outputs and self.scheduler.has_unfinished_requests():
                raise RuntimeError("the scheduler could not schedule any waiting request; the KV cache is too small")
            return outputs
        if not overlap:
            if not self._masks_deferred:
                sched_out.grammar_bitmask = self.structured_output.bitmask(sched_out)
            return outputs + self._process(sched_out, self._execute(sched_out))
        if not self._masks_deferred:  # worker ranks: the masks travel in the step message
            sched_out.grammar_bitmask = self._grammar_bitmask(sched_out)
        launched = self.executor.execute_async(sched_out)
        previous, self._previous = self._previous, None
        if self._previous_outputs is not None:
            outputs, self._previous_outputs = self._previous_outputs, None
        elif previous is not None:
            outputs = self._process(*previous)
        elif self._in_flight is not None:
            outputs = self._finish_in_flight()
        self._in_flight = (sched_out, launched)
        return outputs

    def _propose(self, requests, drafted: dict[str, list[int]]) -> None:
        """Drafts for the next step of every request the verification covers (greedy or sampled, penalties,
        min_tokens, logprobs: exact per position); none under a grammar (its mask is per position) or with a
        token still in flight."""
        for req in requests:
            p = req.params
            if req.is_finished or req.num_pending_tokens or p.structured_outputs is not None:
                continue
            left = None if p.max_tokens is None else p.max_tokens - req.num_output_tokens - 1
            if self.proposer is not None:
                req.spec_token_ids = self.proposer.propose(req.token_ids, left)
            else:
                req.spec_token_ids = drafted.get(req.request_id, [])[:left if left is None else max(left, 0)]

    def _grammar_bitmask(self, sched_out: SchedulerOutput):
        """The step's masks. A constrained request whose previous token is still in flight (async scheduling) needs
        that token first: the step in flight is awaited here and its tokens advance the grammars. The in-process
        runner asks after launching the forward: while llguidance fills the masks (without the GIL), the step
        before's outputs are processed here, work the host would do after the launch anyway."""
        if self._in_flight is None or not self.structured_output.waits_for(self._in_flight[0], sched_out):
            return self.structured_output.bitmask(sched_out)
        previous = self._take_in_flight()
        if not self._masks_deferred:  # worker ranks: the forward waits for these masks, the outputs can wait
            self._previous = previous
            return self.structured_output.bitmask(sched_out)
        masks = self.structured_output.fill_in_background(sched_out)
        self._previous_outputs = self._process(*previous)
        return masks()

    def _execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        result = self.executor.execute(sched_out)
        self.structured_output.advance(result.sampled)
        return result

    def _take_in_flight(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Wait for the step in flight; its tokens advance the grammars at once (the next masks depend on them)."""
        sched_out, launched = self._in_flight
        self._in_flight = None
        result = launched.result()
        self.structured_output.advance(result.sampled)
        return sched_out, result

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        return self._process(*self._take_in_flight())

    def _process(self, sched_out: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        # Requests still known before the update (a finished one is dropped from the scheduler by it).
        live = {rid: req for rid in [*(s.request_id for s in sched_out.scheduled),
                                     *(e.request_id for e in sched_out.encode_only)]
                if (req := self.scheduler.requests.get(rid)) is not None}
        self.ec_loaded += result.ec_loaded_images
        self.ec_saved += result.ec_saved_images
        self.encoder_fallbacks += result.encoder_fallbacks
        progressed = {req.request_id: (req, tokens) for req, tokens in self.scheduler.update_from_output(
            sched_out, result.sampled, result.kv_connector_output)}
        if self.speculates:
            self._propose((req for req, _ in progressed.values()), result.draft_token_ids)
        outputs = []
        self.structured_output.remove([rid for rid, req in live.items() if req.is_finished])
        for rid, req in live.items():
            prompt_lp = result.prompt_logprobs.get(rid)
            tokens = progressed[rid][1] if rid in progressed else None
            if tokens is None and prompt_lp is None:
                continue
            lp = result.logprobs.get(rid)
            outputs.append(EngineCoreOutput(
                request_id=rid,
                new_token_ids=tokens or [],
                finish_reason=req.status.value if req.is_finished else None,
                stop_reason=req.stop_reason,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                logprobs=lp[:len(tokens)] if lp is not None and tokens else None,
                prompt_logprobs=prompt_lp,
                timestamps=(req.arrival_time, self._first_scheduled.pop(rid)) if rid in self._first_scheduled
                else None,
                kv_transfer_params=req.kv_transfer_params if req.is_finished else None,
                pooling_output=result.pooler_output.get(rid)))
        return outputs


def _adapter_names(requests) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})


def _structured_output_manager(config: EngineConfig) -> StructuredOutputManager:
    """Grammars against the model's tokenizer (or the one the config names), loaded on the first constrained
    request; with a reasoning parser, each grammar starts after the model's closing marker."""
    so, mc = config.structured_outputs_config, config.model_config
    markers = REASONING_MARKERS[so.reasoning_parser] if so.reasoning_parser is not None else None
    # Pinned masks when the runner here uploads them to a GPU; worker ranks get them as bytes in the step message.
    pin = config.device.type == "cuda" and config.parallel_config.in_process
    return StructuredOutputManager(lambda: load_tokenizer(so.tokenizer or mc.model), mc.vocab_size,
                                   mc.eos_token_ids, markers, pin_memory=pin)
