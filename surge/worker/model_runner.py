"""ModelRunner: owns the model (or this rank's shard of it), its KV cache and its own per-request state on one
device; runs one step in named parts: prepare inputs, forward, prompt logprobs, sample.

KV memory is sized from a budget: `kv_cache_memory` bytes, or a fraction of the memory free after the weights.
With tensor parallelism every rank runs the same steps from the same message; the ranks agree on one block count,
rank 0 receives the logits and samples, and broadcasts the sampled tokens so every rank can feed them to the next
step on the device (async scheduling).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from surge.attention.backend import AttentionMetadata, default_backend_name, get_backend
from surge.config import EngineConfig
from surge.core.kv_cache.spec import (KVCacheConfig, KVCacheGroup, build_kv_cache_groups, live_block_caps,
                                      num_blocks_for_budget)
from surge.core.kv_connector import KVConnectorOutput
from surge.core.scheduler_output import EncodeRequest, GrammarBitmask, ScheduledRequest, SchedulerOutput
from surge.distributed.parallel_state import get_tp_group, layout_of_rank
from surge.ec_transfer.factory import create_ec_connector
from surge.kernels.token_bitmask import apply_token_bitmask_, bitmask_to_device
from surge.kernels.triton_key import use_cached_triton_key
from surge.kv_transfer.base import KVConnectorRole
from surge.kv_transfer.factory import create_connector
from surge.lora.manager import LoRAManager
from surge.logger import init_logger
from surge.model.layers.moe import warm_up_moe_kernels
from surge.model.layers.sampler import Sampler, SamplingRow, compute_token_logprobs, device_tensor
from surge.model.loader.base import build_model, load_model
from surge.worker.cuda_graph import CUDAGraphRunner, capture_sizes, mixed_capture_sizes
from surge.worker.request_state import CachedRequestState, RequestStates
from surge.worker.draft_model import DraftModel
from surge.worker.mtp_draft import MTPDraft
from surge.worker.encoder_cache import EncoderCache
from surge.worker.image_spans import image_causal_end
from surge.worker.ngram_lookup import DeviceNgram, Verdicts
from surge.worker.pooling import finish_pooled, gather_pooled
from surge.worker.spec_verify import VerifiedDrafts, VerifyResult, verify
from surge.worker.step_inputs import DeviceDrafts, StepInputs
import surge.attention.torch_backend  # noqa: F401,I001  (registers the backends)
import surge.attention.triton_backend  # noqa: F401,I001
import surge.weight_cache.ipc_loader  # noqa: F401,I001  (registers the weight_cache loader)

logger = init_logger(__name__)

_CPU_DEFAULT_KV_BYTES = 2 << 30  # the CPU shares memory with everything else: a modest default

TokenLogprobs = tuple[list[int], list[float], int]  # (token ids, logprobs, rank of the sampled one); ids[0] sampled
# (first prompt position covered, ids [m, 1+N], logprobs [m, 1+N], ranks [m]); row j scores prompt token
# (first + j + 1) given the tokens before it.
PromptLogprobs = tuple[int, list[list[int]], list[list[float]], list[int]]


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's result, the same from every executor (it crosses from rank 0 as it is)."""
    sampled: dict[str, list[int]] = {}  # request id -> new tokens (1 + accepted drafts)
    logprobs: dict[str, list[TokenLogprobs]] = {}  # request id -> one entry per new token
    prompt_logprobs: dict[str, PromptLogprobs] = {}
    kv_connector_output: KVConnectorOutput | None = None  # with a KV connector: loads and saves that finished
    draft_token_ids: dict[str, list[int]] = {}  # a draft model's proposals for each sampling request's next step
    pooler_output: dict[str, list[float]] = {}  # pooling requests whose prompt the step completed: their output
    # Encoder disaggregation: images this step took from the EC connector, saved to it (an encoder instance), and
    # encoded here although the connector was asked for them (fallbacks).
    ec_loaded_images: int = 0
    ec_saved_images: int = 0
    encoder_fallbacks: int = 0


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def kv_cache_groups(config: EngineConfig, rank: int = 0, model: torch.nn.Module | None = None
                    ) -> tuple[KVCacheGroup, ...]:
    """The KV cache groups of one rank: one per distinct spec its attention layers declare (its share of the KV heads;
    the block count is the same on every rank: the smallest any rank can hold). Without the rank's model, from a
    build of it on the meta device (no weights, no memory)."""
    if model is None:
        with layout_of_rank(config.parallel_config, rank):
            model = build_model(config.model_config, torch.device("meta"))
    return build_kv_cache_groups(layer_kv_specs(model, config))


def kv_live_block_caps(config: EngineConfig, groups: tuple[KVCacheGroup, ...]) -> tuple[int | None, ...]:
    """Per group, the pool cap of a sliding window (KVCacheConfig.live_block_caps) under this engine's limits: the
    same on every rank and in the engine, which sizes its managers from it."""
    sc, spec = config.scheduler_config, config.speculative_config
    k = spec.num_speculative_tokens if spec is not None else 0
    # Drafts in flight (k, and the pending token) may move a step's start back; lookahead slots forward.
    return live_block_caps(groups, sc.max_num_seqs, sc.max_num_batched_tokens, 2 * (k + 2))


def layer_kv_specs(model: torch.nn.Module, config: EngineConfig) -> list:
    cc, mc = config.cache_config, config.model_config
    return [attn.kv_cache_spec(cc.block_size, cc.cache_dtype(mc.dtype)) for attn in model.attention_layers()]


def distinct_attention_params(model: torch.nn.Module) -> tuple:
    """The model's attention layers' distinct parameters, in layer order: what kernel warm-up compiles."""
    return tuple(dict.fromkeys(attn.params for attn in model.attention_layers()))


@dataclass
class StepBatch:
    """A step's inputs once prepared: what forward, prompt logprobs and sampling read."""
    scheduled: list[ScheduledRequest]
    states: list[CachedRequestState]
    num_tokens: int
    num_reqs: int
    meta: list[AttentionMetadata]  # one per KV cache group
    sample_idx: list[int]  # token index of each sampling request's last position, in step order
    sample_states: list[CachedRequestState]
    grammar_bitmask: GrammarBitmask | None = None  # structured output: the allowed tokens of constrained rows
    grammar_source: Callable[[], GrammarBitmask | None] | None = None  # or where to ask for them, at sampling


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        mc = config.model_config
        start = time.perf_counter()
        self.model = load_model(config, self.device)  # from disk, or mapped from the weight-cache daemon
        self.load_seconds = time.perf_counter() - start
        logger.info("loaded %s (%s, %s) in %.2f s", mc.architecture, mc.dtype, self.device, self.load_seconds)
        self.sampler = Sampler(max_batch=config.scheduler_config.max_num_seqs)
        # The last step's sampled tokens, still on the device (on every rank), and each request's row in them.
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self.tp = get_tp_group()
        self.samples = self.tp.rank == 0  # the rank that receives logits
        self.backend = get_backend(default_backend_name(self.device))
        spec = config.speculative_config  # a draft model (or the target's MTP layer): its own KV layers, same blocks
        self.draft: DraftModel | None = None
        if spec is not None and spec.uses_draft_model:
            self.draft = (MTPDraft if spec.method == "deepseek_mtp" else DraftModel)(config, self.device, self.model)
        # n-gram drafts under async scheduling: looked up here, on the device, after every sampling step, so a
        # request's next step can be launched before its verdict reaches the host (the engine looks them up on
        # the host otherwise). _ahead: what the last step left for such a step (a draft model's drafts too).
        self.ngram = (DeviceNgram(spec, mc.max_model_len, self.device) if spec is not None and spec.method == "ngram"
                      and config.scheduler_config.async_scheduling else None)
        self._ahead: DeviceDrafts | None = None
        self._verified: tuple[list[str], list[int], VerifyResult | None] | None = None  # this step's verdicts
        start = time.perf_counter()
        self.kv_cache_config = self._size_kv_cache()
        self._allocate_kv_cache()
        self.kv_cache_seconds = time.perf_counter() - start  # sizing and allocation, for start-up reports
        if self.draft is not None:
            self.draft.bind_kv_cache(self.kv_cache_config, self.backend)
        # The worker half of the KV connector, if any: it moves blocks between these caches and its store.
        self.kv_connector = create_connector(config, KVConnectorRole.WORKER, self.kv_cache_config)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        # An M-RoPE model (Qwen2.5-VL) takes [3, T] positions: each request's prompt table is computed once here.
        mrope = getattr(self.model, "uses_mrope", False)
        if mrope and spec is not None:
            raise ValueError(f"speculative decoding is not supported with {mc.architecture} (M-RoPE positions) yet")
        self.requests = RequestStates(len(self.kv_cache_config.groups), self.device,
                                      self.model.mrope_positions if mrope else None)
        # Encoder disaggregation: embeddings saved for (encoder instance) or loaded from (prefill instance) another.
        self.ec_connector = create_ec_connector(config)
        if self.ec_connector is not None and not hasattr(self.model, "embed_images"):
            raise ValueError(f"ec_transfer_config (--ec-transfer-config) needs a multimodal model; {mc.architecture} "
                             "takes no images")
        self.encoder_cache = EncoderCache(self.device, self.ec_connector)  # image embeddings until prefilled
        # Structured output, in-process only: called with the step message once its forward is launched, returns
        # the masks (filled while the device runs it); None: they come in the message.
        self.grammar_bitmask_source: Callable[[SchedulerOutput], GrammarBitmask | None] | None = None
        cc, sc = config.cache_config, config.scheduler_config
        self.inputs = StepInputs(max(sc.max_num_batched_tokens, sc.max_num_seqs), sc.max_num_seqs,
                                 -(-mc.max_model_len // cc.block_size), len(self.kv_cache_config.groups),
                                 cc.block_size, self.device, mrope=mrope)
        # LoRA: slot pools on the linear layers, and each step's token -> slot mapping (graphs capture its buffers).
        self.lora = None
        if config.lora_config is not None:
            self.lora = LoRAManager(self.model, config.lora_config, self.inputs.input_ids.shape[0], mc.dtype,
                                    self.device)
        if self.device.type == "cuda":
            use_cached_triton_key()  # before the process's first Triton compile, on whichever thread that is
        self.graph_runner: CUDAGraphRunner | None = None
        # A backend's graph-safe paths read lengths on the device; its host-side ones (MLA for now) need exact ones.
        self.graph_safe = self.backend.supports_cuda_graphs_for(distinct_attention_params(self.model))
        # Gemma 3: an image's tokens attend to each other both ways (steps computing images run eagerly).
        self.bidirectional_spans = any(p.bidirectional_spans for p in distinct_attention_params(self.model))
        graphs = not config.enforce_eager and self.graph_safe
        # Under TP a capture records collectives, whose order must match on every rank: all at start-up.
        background = graphs and config.cuda_graph_capture == "background" and self.tp.world_size == 1
        # Background: the kernel warm-up and every capture run on a thread once the first step is launched (or the
        # engine has idled a second), off a restart's way to its first token; that step runs eagerly, its few
        # kernels loaded from Triton's cache as it launches them.
        self.first_step_launched = threading.Event()
        self.warmup_seconds = 0.0 if background else self._warm_up_kernels()  # start-up's share
        if graphs:
            lora_mapping = self.lora.mapping if self.lora is not None and self.lora.mapping.use_kernels else None
            self.graph_runner = CUDAGraphRunner(self.model, self.inputs, self.backend, sc.max_num_seqs,
                                                mc.max_model_len, lora_mapping)
            if not background:
                self.graph_runner.capture()
        if self.draft is not None:  # its graphs: decode passes over its buffers, each step's forward over these
            self.draft.capture_graphs(self.inputs)
        if background:  # after every start-up capture (the draft's)
            self.graph_runner.capture_in_background(prepare=self._warm_up_kernels, after=self.first_step_launched)

    # ---- start-up ----
    def _warm_up_kernels(self) -> float:
        """Compile every kernel variant the runtime will dispatch before serving, so no request or graph capture
        waits for the compiler."""
        mc, cc, sc = self.config.model_config, self.config.cache_config, self.config.scheduler_config
        sizes = capture_sizes(sc.max_num_seqs) if not self.config.enforce_eager else []
        start = time.perf_counter()
        compiled = self.backend.warm_up(self.device, distinct_attention_params(self.model), cc.block_size, mc.dtype, sizes,
                                        sc.max_num_seqs, self.config.warmup_workers, cc.cache_dtype(mc.dtype))
        compiled += self.model.warm_up_kernels(self.backend, self.device, cc.block_size, self.config.warmup_workers)
        if self.device.type == "cuda":  # MoE layers: their kernels at every graph's token count
            compiled += warm_up_moe_kernels(self.model, self.moe_warm_up_tokens(), self.config.warmup_workers)
        seconds = time.perf_counter() - start
        if compiled:
            logger.info("kernel warm-up: %d attention (and model) kernel variant(s) compiled in %.2f s with up to %d "
                        "worker(s)", compiled, seconds, self.config.warmup_workers)
        if self.samples:  # the rank that samples: the top-k/top-p kernel for the model's dtype and float32
            seconds += self.sampler.warm_up(self.device, sc.max_num_seqs, mc.vocab_size, mc.dtype,
                                            max_workers=self.config.warmup_workers)
        if self.lora is not None and self.lora.mapping.use_kernels:
            seconds += self.lora.warm_up()
        spec = self.config.speculative_config
        if spec is not None and self.config.scheduler_config.async_scheduling and self.device.type == "cuda":
            start = time.perf_counter()  # the kernels of steps scheduled ahead of their verdict: one variant each
            if self.ngram is not None:
                self.ngram.warm_up()
            self.inputs.warm_up_ahead(spec.num_speculative_tokens)
            seconds += time.perf_counter() - start
        return seconds

    def moe_warm_up_tokens(self) -> list[int]:
        """The token counts the MoE kernels are compiled for: the CUDA graphs' (decode batches, mixed steps); an
        eager step of another count may still compile its variant as it launches."""
        if self.config.enforce_eager or not self.graph_safe:
            return []
        sc = self.config.scheduler_config
        return sorted(set(capture_sizes(sc.max_num_seqs)) | set(mixed_capture_sizes(self.inputs.input_ids.shape[0])))

    def _size_kv_cache(self) -> KVCacheConfig:
        mc, cc = self.config.model_config, self.config.cache_config
        if cc.kv_cache_dtype != "auto" and self.device.type == "cuda" and \
                torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(f"kv_cache_dtype={cc.kv_cache_dtype!r} needs a GPU of compute capability 8.9 or newer "
                             f"(float8 conversions); {torch.cuda.get_device_name(self.device)} has "
                             f"{torch.cuda.get_device_capability(self.device)}")
        groups = kv_cache_groups(self.config, self.tp.rank, self.model)
        caps = kv_live_block_caps(self.config, groups)
        draft_bytes = self.draft.bytes_per_block(cc.block_size) if self.draft else 0
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        else:
            if cc.kv_cache_memory is not None:
                budget = cc.kv_cache_memory
            else:
                budget = int(available_memory(self.device) * cc.memory_fraction)
                if self.device.type == "cpu":  # the node's ranks share its RAM
                    budget = min(budget, _CPU_DEFAULT_KV_BYTES) // self.config.parallel_config.local_world_size
            num_blocks = num_blocks_for_budget(groups, caps, budget, draft_bytes)
            num_blocks = self.tp.min_int(num_blocks)  # free memory differs a little from rank to rank
        kvc = KVCacheConfig(groups, num_blocks, caps)
        total = kvc.total_bytes + num_blocks * draft_bytes
        capacity = (num_blocks - 1) * cc.block_size
        if capacity < mc.max_model_len:
            raise ValueError(
                f"the KV cache budget holds {capacity} tokens ({num_blocks - 1} blocks of {cc.block_size}, "
                f"{kvc.bytes_per_block + draft_bytes} bytes each), fewer than max_model_len={mc.max_model_len}; "
                "raise kv_cache_memory / memory_fraction or lower max_model_len")
        pools = [kvc.num_blocks_of(g.group_id) for g in groups if caps[g.group_id] is not None]
        logger.info("KV cache: %s, %d tokens (%d blocks x %d) per group, %d group(s)%s, %.1f MiB",
                    str(cc.cache_dtype(mc.dtype)).removeprefix("torch."), capacity, num_blocks - 1, cc.block_size,
                    len(groups), f" (sliding windows' pools: {pools} blocks)" if pools else "", total / 2**20)
        return kvc

    def _allocate_kv_cache(self) -> None:
        """One tensor per layer, in the layout its backend asks for."""
        kvc = self.kv_cache_config
        self.kv_caches: list[torch.Tensor] = []
        for layer_id, attn in enumerate(self.model.attention_layers()):
            group = kvc.group_of_layer(layer_id)
            spec = group.spec
            shape = self.backend.kv_cache_shape(kvc.num_blocks_of(group.group_id), spec)
            # Not zeroed: no backend reads a slot no request wrote (both are tested with NaN there), and a fill would
            # touch every page of the budget before the first request (seconds for a few GiB on some CPU hosts).
            cache = torch.empty(shape, dtype=spec.dtype, device=self.device)
            attn.kv_cache, attn.group_id, attn.backend = cache, group.group_id, self.backend
            self.kv_caches.append(cache)

    # ---- one step ----
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(out).result()

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput) -> PendingOutput:
        """Launch the step on the device and return without waiting for it. Its sampled tokens stay on the device
        too, where the next step reads any token it needs before the host has it."""
        states = self.requests.apply(out)
        if self.encoder_cache.users and out.finished_ids:
            self.encoder_cache.drop_requests(out.finished_ids)
        if self.ngram is not None:
            self.ngram.remove(out.finished_ids)
        if self.lora is not None:
            for lora_id in out.removed_lora_ids:
                self.lora.remove(lora_id)
        pending = PendingOutput()
        if out.encode_only:
            self._encode_and_save(out.encode_only, pending)
        connector = self.kv_connector
        if connector is not None:
            connector.start_load_kv(out.kv_connector_metadata)  # synchronous loads land before the forward
        if out.scheduled:
            batch = self.prepare_inputs(out.scheduled, states)
            batch.grammar_bitmask = out.grammar_bitmask
            batch.grammar_source = self.grammar_bitmask_source and (lambda: self.grammar_bitmask_source(out))
            hidden = self.forward(batch)
            if self.config.model_config.runner == "pooling":
                self.pool(batch, hidden, pending)
            self.compute_prompt_logprobs(batch, hidden, pending)
            self.sample(batch, hidden, pending)
            if self.draft is not None:  # its KV for this step's tokens, then k proposals per sampling request
                drafted = self.draft.after_sampling(self.inputs, batch, hidden, self._last_sampled, self._last_rows,
                                                    self._verified, self._ahead)
                self._ahead = None
                if drafted is not None:
                    rids, drafts, first, rejected = drafted
                    self._ahead = DeviceDrafts.of(rids, first, drafts, rejected)
                    if self.samples:
                        pending.drafts = (rids, _to_host(drafts))
            if self.ngram is not None:
                self._propose_ngram(batch, pending)
        if connector is not None:
            connector.save_kv()
            pending.kv_output = connector.get_finished()
        cache = self.encoder_cache
        if cache.num_loaded or cache.num_fallbacks:
            pending.ec_loaded_images, pending.encoder_fallbacks = cache.num_loaded, cache.num_fallbacks
            cache.num_loaded = cache.num_fallbacks = 0
        if self.device.type == "cuda":
            pending.done = torch.cuda.Event()
            pending.done.record()
        if not out.is_empty and not self.first_step_launched.is_set():
            self.first_step_launched.set()
        return pending

    def _encode_and_save(self, requests: list[EncodeRequest], pending: PendingOutput) -> None:
        """An encoder instance's step: every distinct image of these requests through the vision tower in one call,
        then saved through the EC connector (rank 0's; a tower replicated under TP computes the same rows)."""
        features = list({f.identifier: f for e in requests for f in e.mm_features}.values())
        if not features:
            return
        embeds = self.model.embed_images(features, self.device)
        if not self.samples:
            return
        for f, rows in zip(features, embeds, strict=True):
            if rows.shape[0] != f.length:
                raise ValueError(f"an image's encoder output has {rows.shape[0]} rows but its prompt holds "
                                 f"{f.length} placeholder tokens")
            self.ec_connector.save(f.identifier, rows)
        pending.ec_saved_images = len(features)

    def prepare_inputs(self, scheduled: list[ScheduledRequest], states: list[CachedRequestState]) -> StepBatch:
        """Token ids, positions, slot mappings and block tables into the persistent buffers; metadata per group."""
        graphs = self.graph_runner
        num_tokens, num_reqs, query_start_loc, seq_lens = self.inputs.fill(
            scheduled, states, self._last_sampled, self._last_rows,
            mixed_padding=graphs.mixed_padding if graphs is not None else None, ahead=self._ahead,
            exact_host_lengths=not self.graph_safe)
        if self.lora is not None:
            self.lora.set_step([state.lora_request for state in states], [s.num_new_tokens for s in scheduled])
        max_query_len = max(s.num_new_tokens for s in scheduled)
        meta = self.inputs.metadata(self.backend, num_tokens, num_reqs, query_start_loc, seq_lens, max_query_len,
                                    max(seq_lens))
        if self.bidirectional_spans:
            causal_end = image_causal_end(scheduled, states, query_start_loc, num_tokens, self.device)
            for m in meta:
                m.causal_end = causal_end
        # Requests with drafts sample in the verification (spec_verify.py), the others here.
        plain = [s.samples and not s.num_drafts for s in scheduled]
        sample_idx = [query_start_loc[i + 1] - 1 for i, yes in enumerate(plain) if yes]
        sample_states = [state for yes, state in zip(plain, states) if yes]
        return StepBatch(scheduled, states, num_tokens, num_reqs, meta, sample_idx, sample_states)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Final hidden states of every scheduled token: a captured graph for the decode batches and the small mixed
        steps it covers."""
        n = batch.num_tokens
        inputs_embeds = self._merged_image_embeds(batch)
        if inputs_embeds is not None:  # a step that prefills image placeholders: eager
            return self.model(self.inputs.input_ids[:n], self.inputs.model_positions(n), batch.meta, inputs_embeds)
        graphs = self.graph_runner
        if graphs is not None:
            if batch.meta[0].decode_only and graphs.padded_size(batch.num_reqs):
                return graphs.replay(batch.num_reqs, self.lora is None or self.lora.mapping.num_groups > 0)
            if not batch.meta[0].decode_only and graphs.mixed_size(batch.num_tokens, batch.num_reqs):
                return graphs.replay_mixed(batch.num_tokens, batch.num_reqs)
        return self.model(self.inputs.input_ids[:n], self.inputs.model_positions(n), batch.meta)

    def _merged_image_embeds(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's input embeddings with image rows at the placeholder positions it computes (each image encoded
        once, kept in the encoder cache until its request has prefilled it); None for a step with no image rows."""
        spans = []  # (step row, request id, feature, first and end row of its embeddings)
        qsl = None
        for i, (s, state) in enumerate(zip(batch.scheduled, batch.states)):
            if not state.mm_features:
                continue
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            for f in state.mm_features:
                if f.offset < end and f.end > start:
                    qsl = batch.meta[0].query_start_loc if qsl is None else qsl
                    lo, hi = max(start, f.offset), min(end, f.end)
                    spans.append((qsl[i] + lo - start, state.request_id, f, lo - f.offset, hi - f.offset))
        if not spans:
            return None
        cache = self.encoder_cache
        cache.encode(self.model, [(rid, f) for _, rid, f, _, _ in spans])
        embeds = self.model.embed_input_ids(self.inputs.input_ids[:batch.num_tokens])
        for row, rid, f, a, b in spans:
            embeds[row:row + b - a] = cache.embeds[f.identifier][a:b]
        # Released once the request has prefilled every span of that image (a prompt may show one image twice).
        ends = {s.request_id: s.num_computed_tokens + s.num_new_tokens for s in batch.scheduled}
        for _, rid, f, _, b in spans:
            state = self.requests.requests[rid]
            if b == f.length and all(g.end <= ends[rid] for g in state.mm_features if g.identifier == f.identifier):
                cache.release(f.identifier, rid)
        return embeds

    def pool(self, batch: StepBatch, hidden: torch.Tensor, pending: PendingOutput) -> None:
        """Pooling requests: this step's rows into their pooled state; the outputs of those it completes."""
        mc = self.config.model_config
        done = gather_pooled(mc.pooler_config.type, batch.scheduled, batch.states, batch.meta[0].query_start_loc,
                             hidden)
        if done:
            out = finish_pooled(self.model, mc, done)
            if out is not None and self.samples:
                pending.pooled = [(rid, _to_host(row)) for rid, row in out.items()]

    def compute_prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor, pending: PendingOutput) -> None:
        """Logprobs of the prompt tokens this step computes, for requests that ask (each position once)."""
        qsl = batch.meta[0].query_start_loc if batch.meta else []
        for i, (s, req) in enumerate(zip(batch.scheduled, batch.states)):
            if req.params.prompt_logprobs is None:
                continue
            lo = max(s.num_computed_tokens, req.num_prompt_logprobs_done)
            hi = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
            if hi <= lo:
                continue
            idx = [qsl[i] + p - s.num_computed_tokens for p in range(lo, hi)]
            logits = self.model.compute_logits(hidden[device_tensor(idx, self.device, torch.long)])
            if logits is not None:
                targets = device_tensor(req.prompt_token_ids[lo + 1:hi + 1], self.device, torch.long)
                ids, lps, ranks = compute_token_logprobs(logits.float(), targets, req.params.prompt_logprobs)
                pending.prompt_logprobs.append((req.request_id, lo, _to_host(ids), _to_host(lps), _to_host(ranks)))
            req.num_prompt_logprobs_done = hi

    def sample(self, batch: StepBatch, hidden: torch.Tensor, pending: PendingOutput) -> None:
        """One token per sampling request: logits of their last positions, the sampler on rank 0, then the tokens
        broadcast to every rank (on the device), where the next step's inputs take them from."""
        self._verify_drafts(batch, hidden, pending)
        if not batch.sample_idx:
            return
        idx = batch.sample_idx
        # Decode-only: every row samples, in order.
        rows_hidden = hidden if len(idx) == hidden.shape[0] else hidden[device_tensor(idx, self.device, torch.long)]
        logits = self.model.compute_logits(rows_hidden)  # None on ranks other than 0
        sample_ids = [req.request_id for req in batch.sample_states]
        if batch.grammar_source is not None:  # the forward and the logits are queued: the host fills masks now
            batch.grammar_bitmask = batch.grammar_source()
        if logits is not None and batch.grammar_bitmask is not None:
            _apply_grammar(logits, batch.grammar_bitmask, sample_ids)
        if logits is not None:
            sampler_out = self.sampler(logits, [self._sampling_row(s, req) for s, req in
                                                zip(batch.scheduled, batch.states)
                                                if s.samples and not s.num_drafts])
            sampled = sampler_out.sampled_token_ids
            pending.sample_ids = sample_ids
            pending.num_logprobs = [req.params.logprobs for req in batch.sample_states]
            pending.sampled = _to_host(sampled)
            if sampler_out.logprobs is not None:
                pending.logprobs = (_to_host(sampler_out.logprob_token_ids), _to_host(sampler_out.logprobs),
                                    _to_host(sampler_out.sampled_token_ranks))
        else:
            sampled = torch.empty(len(idx), dtype=torch.int64, device=self.device)
        self._last_sampled = self.tp.broadcast(sampled)
        self._last_rows = {rid: j for j, rid in enumerate(sample_ids)}

    def _verify_drafts(self, batch: StepBatch, hidden: torch.Tensor, pending: PendingOutput) -> None:
        """Requests with drafts: the logits at the position of the last known token and of each draft, verified
        exactly (spec_verify.py: greedy or sampled, penalties and min_tokens per position), on rank 0. A request's
        next step waits for the host (the scheduler holds it while the verdict is in flight), or, with device
        drafts, takes what the verdict left from the device (_propose_ngram)."""
        qsl = batch.meta[0].query_start_loc
        requests, num_drafts, idx = [], [], []
        for i, (s, state) in enumerate(zip(batch.scheduled, batch.states)):
            if s.num_drafts:
                # A row scheduled ahead starts after tokens the host has not seen; any other follows them all.
                assert s.device_drafts or s.num_computed_tokens + 1 == state.num_tokens, (s.request_id,
                                                                                          s.num_computed_tokens)
                k = s.num_drafts
                requests.append((state, s.spec_token_ids or k))
                num_drafts.append(k)
                idx.extend(range(qsl[i + 1] - 1 - k, qsl[i + 1]))
        self._verified = None
        if not requests:
            return
        # The rows are usually one range (every request of the step verifies: all its tokens), a view: no index
        # upload and no gather launch.
        one_range = idx[-1] - idx[0] + 1 == len(idx)
        rows = hidden[idx[0]:idx[-1] + 1] if one_range else hidden[device_tensor(idx, self.device, torch.long)]
        logits = self.model.compute_logits(rows)
        # Device drafts are known only there: read from the step's own input tokens (in one range of k + 1 tokens
        # per request, the last k of each: a view).
        draft_ids = None
        if any(isinstance(d, int) for _, d in requests):
            k = num_drafts[0]
            if one_range and all(d == k for d in num_drafts):
                draft_ids = self.inputs.input_ids[idx[0]:idx[-1] + 1].view(-1, k + 1)[:, 1:].reshape(-1)
            else:
                # Of each request's k + 1 rows in idx, the last k.
                ends = np.cumsum([d + 1 for d in num_drafts])
                draft_pos = [idx[j] for end, d in zip(ends, num_drafts) for j in range(end - d, end)]
                draft_ids = self.inputs.input_ids[device_tensor(draft_pos, self.device, torch.long)]
        out = (verify(logits, requests, device_verdicts=self.draft is not None or self.ngram is not None,
                      draft_ids=draft_ids) if logits is not None else None)
        request_ids = [state.request_id for state, _ in requests]
        self._verified = (request_ids, num_drafts, out)
        if out is None:
            return
        pending.verify = VerifiedDrafts(
            request_ids, [d if isinstance(d, int) else list(d) for _, d in requests],
            [state.params.logprobs for state, _ in requests], _to_host(out.token_ids),
            None if out.num_accepted is None else _to_host(out.num_accepted),
            None if out.logprobs is None else tuple(_to_host(t) for t in out.logprobs))

    def _propose_ngram(self, batch: StepBatch, pending: PendingOutput) -> None:
        """After sampling: every sampling request's new tokens join its device history (the sampled one, or the
        verdict's 1 + j), then its n-gram drafts are looked up there. They stay on the device for a next step
        scheduled ahead of this one's verdict (_ahead) and go to the host for one that waits (the engine's drafts).
        Rank 0 verified; the other ranks learn the verdicts by one broadcast and look the drafts up alike."""
        plain = batch.sample_states
        verified = self._verified
        self._ahead = None
        if not plain and verified is None:
            return
        ngram, states = self.ngram, list(plain)
        sampled = self._last_sampled[:len(plain)] if plain else None
        verdicts = None
        if verified is not None:
            ids, num_drafts, out = verified
            starts = np.cumsum([0] + [d + 1 for d in num_drafts[:-1]], dtype=np.int64).tolist()
            if self.tp.world_size > 1:  # rank 0 verified: its verdicts and accepted counts to every rank
                width = ngram.k + 1
                buf = torch.zeros(len(ids), width + 1, dtype=torch.int64, device=self.device)
                if out is not None:
                    cols = np.minimum(np.arange(width)[None, :], np.asarray(num_drafts)[:, None])
                    buf[:, :width] = out.token_ids[device_tensor(np.asarray(starts)[:, None] + cols, self.device)]
                    buf[:, width] = out.num_accepted
                buf = self.tp.broadcast(buf)
                verdicts = Verdicts(buf.view(-1), [j * (width + 1) for j in range(len(ids))], num_drafts,
                                    buf[:, width])
            else:
                verdicts = Verdicts(out.token_ids, starts, num_drafts, out.num_accepted)
            by_id = {state.request_id: state for state in batch.states}
            states += [by_id[rid] for rid in ids]
        rows = []
        for state in states:
            row = ngram.row_of.get(state.request_id)
            if row is None:  # its first sample: the runner holds every token so far
                row = ngram.add(state.request_id, device_tensor(state.token_ids, self.device, torch.long))
            rows.append(row)
        tokens, rejected, valid = ngram.step(rows, sampled, verdicts)
        rids = [state.request_id for state in states]
        self._ahead = DeviceDrafts(dict(zip(rids, range(len(rids)))), tokens, rejected)
        if self.samples:
            pending.drafts = (rids, _to_host(tokens)[:, 1:])
            pending.num_valid_drafts = _to_host(valid)

    def _sampling_row(self, s: ScheduledRequest, req: CachedRequestState) -> SamplingRow:
        p = req.params
        # Tokens generated before this one: the sampled token sits at position computed + new.
        num_generated = s.num_computed_tokens + s.num_new_tokens - req.num_prompt_tokens
        history = p.uses_penalties
        if history and num_generated != req.num_output_tokens:
            raise RuntimeError(f"request {req.request_id!r} uses penalties, which need every earlier token on the "
                               "host; the engine must not schedule it ahead of them")
        return SamplingRow(p, req.prompt_token_ids, req.output_token_ids if history else [], req.generator,
                           num_generated)


def _apply_grammar(logits: torch.Tensor, mask: GrammarBitmask, sample_ids: list[str]) -> None:
    """Disallowed tokens of the constrained rows to -inf, before the sampler and logprobs read the logits."""
    words = bitmask_to_device(mask.bitmask, len(mask.request_ids), mask.num_words, logits.device)
    rows = None
    if mask.request_ids != sample_ids:
        row_of = {rid: j for j, rid in enumerate(sample_ids)}
        rows = device_tensor([row_of[rid] for rid in mask.request_ids], logits.device, torch.long)
    apply_token_bitmask_(logits, words, rows)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor to (pinned) host memory; PendingOutput.result() waits for it."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class PendingOutput:
    """A launched step: host copies of its results, complete once `done` (a CUDA event) has passed."""
    done: torch.cuda.Event | None = None
    sample_ids: list[str] = field(default_factory=list)  # request ids of the sampled rows, in order
    num_logprobs: list[int | None] = field(default_factory=list)
    sampled: torch.Tensor | None = None
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    prompt_logprobs: list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    kv_output: KVConnectorOutput | None = None
    verify: VerifiedDrafts | None = None
    drafts: tuple[list[str], torch.Tensor] | None = None  # the proposals for each request's next step: ids, [n, k]
    num_valid_drafts: torch.Tensor | None = None  # [n]: of each row, the leading drafts to use (device n-gram)
    pooled: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # request id, pooled output
    ec_loaded_images: int = 0
    ec_saved_images: int = 0
    encoder_fallbacks: int = 0

    def ready(self) -> bool:
        """True once result() would not wait."""
        return self.done is None or self.done.query()

    def result(self) -> ModelRunnerOutput:
        if self.done is not None:
            self.done.synchronize()
        result = ModelRunnerOutput(kv_connector_output=self.kv_output, ec_loaded_images=self.ec_loaded_images,
                                   ec_saved_images=self.ec_saved_images, encoder_fallbacks=self.encoder_fallbacks)
        if self.sampled is not None:
            result.sampled = {rid: [token] for rid, token in zip(self.sample_ids, self.sampled.tolist())}
        if self.logprobs is not None:
            ids, lps, ranks = (t.tolist() for t in self.logprobs)
            for j, (rid, num) in enumerate(zip(self.sample_ids, self.num_logprobs)):
                if num is not None:
                    result.logprobs[rid] = [(ids[j][:1 + num], lps[j][:1 + num], ranks[j])]
        if self.verify is not None:
            self.verify.into(result)
        if self.drafts is not None:
            result.draft_token_ids = dict(zip(self.drafts[0], self.drafts[1].tolist()))
            if self.num_valid_drafts is not None:
                for rid, n in zip(self.drafts[0], self.num_valid_drafts.tolist()):
                    del result.draft_token_ids[rid][n:]
        if self.pooled:
            result.pooler_output = {rid: row.tolist() for rid, row in self.pooled}
        for rid, first, ids, lps, ranks in self.prompt_logprobs:
            result.prompt_logprobs[rid] = (first, ids.tolist(), lps.tolist(), ranks.tolist())
        return result
