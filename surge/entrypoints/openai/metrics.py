"""Prometheus metrics for GET /metrics, with vLLM V1's names, types, labels and bucket boundaries under Surge's
prefix (`surge:`), or under `vllm:` (`surge serve --metrics-prefix vllm`) so that vLLM's dashboards and alerts work
unchanged. Left out are the ones whose feature Surge lacks: sleep mode, KV-connector and multi-modal caches,
speculative decoding, LoRA, NaN detection, KV-block residency sampling, and the hidden deprecated ones.

Counters show as `<name>_total` without `_created` series; success counts requests, not their n samples.
"""
from __future__ import annotations

import dataclasses
import re

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from surge.config import EngineConfig
from surge.engine.core import SchedulerStats
from surge.engine.output_processor import FinishedRequestStats, IterationStats

FINISH_REASONS = ("stop", "length", "abort")
_PREFIX = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def check_metrics_prefix(prefix: str) -> str:
    if not _PREFIX.match(prefix or ""):
        raise ValueError(f"metrics_prefix={prefix!r} is invalid: it must be a Prometheus name (letters, digits and "
                         "underscores, not starting with a digit), e.g. surge or vllm")
    return prefix


class PrometheusMetrics:
    """A StatsObserver for AsyncLLM; its own registry, so several servers can live in one process (tests)."""

    def __init__(self, model_name: str, config: EngineConfig, num_gpu_blocks: int = 0, prefix: str = "surge") -> None:
        prefix = check_metrics_prefix(prefix)
        prometheus_client.disable_created_metrics()  # a `_created` series per counter doubles the series count
        self.registry = r = CollectorRegistry()
        labels, values = ["model_name", "engine"], {"model_name": model_name, "engine": "0"}
        max_model_len = config.scheduler_config.max_model_len

        def metric(cls, name: str, documentation: str, **kwargs):
            return cls(f"{prefix}:{name}", documentation, labels, registry=r, **kwargs).labels(**values)

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return metric(Histogram, name, documentation, buckets=buckets)

        # Scheduler state
        self.running = metric(Gauge, "num_requests_running", "Number of requests in model execution batches.")
        self.waiting = metric(Gauge, "num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = metric(Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = metric(Counter, "prefix_cache_queries",
                                     "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = metric(Counter, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                  "tokens.")
        # Counters
        self.preemptions = metric(Counter, "num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Number of generation tokens processed.")
        success = Counter(f"{prefix}:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(**values, finished_reason=reason) for reason in FINISH_REASONS}
        # Histograms of counts
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          _ITERATION_TOKEN_BUCKETS)
        self.max_num_generation_tokens = histogram("request_max_num_generation_tokens", "Histogram of maximum number "
                                                   "of requested generation tokens.", token_buckets)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "Histogram of the max_tokens request "
                                           "parameter.", token_buckets)
        # Histograms of timing intervals
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _TOKEN_LATENCY_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.",
                                      _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        _REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", _REQUEST_LATENCY_BUCKETS)
        # A KV connector's (only with one, so a plain engine's names stay exactly vLLM's): the external prefix
        # cache as vLLM names it, then what the connector moved.
        self.connector = None
        if config.kv_transfer_config is not None:
            self.connector = {
                "kv_external_queries": metric(Counter, "external_prefix_cache_queries", "External prefix cache "
                                              "queries from KV connector cross-instance cache sharing, in terms of "
                                              "number of queried tokens."),
                "kv_external_hit_tokens": metric(Counter, "external_prefix_cache_hits", "External prefix cache "
                                                 "hits from KV connector cross-instance cache sharing, in terms of "
                                                 "number of cached tokens."),
                "kv_loaded_bytes": metric(Counter, "kv_connector_loaded_bytes", "Bytes of KV the connector loaded."),
                "kv_saved_bytes": metric(Counter, "kv_connector_saved_bytes", "Bytes of KV the connector saved."),
                "kv_load_seconds": metric(Counter, "kv_connector_load_seconds", "Seconds the connector spent "
                                          "loading KV."),
                "kv_save_seconds": metric(Counter, "kv_connector_save_seconds", "Seconds the connector spent "
                                          "saving KV."),
                "kv_failures": metric(Counter, "kv_connector_failures", "Failed or partial KV loads (recomputed) "
                                      "and store errors."),
            }
            self.connector_usage = metric(Gauge, "kv_connector_storage_usage_perc", "Share of the connector's own "
                                          "storage in use (the offload tier's pool). 1 means 100 percent.")
        # Encoder disaggregation (only with an EC connector): images whose embeddings came from the encoder
        # instance, those an encoder instance saved, and those encoded here because they were not there.
        self.ec = None
        if config.ec_transfer_config is not None:
            self.ec = {
                "ec_loaded_images": metric(Counter, "ec_connector_loaded_images", "Images whose embeddings the EC "
                                           "connector supplied (encoded by the encoder instance)."),
                "ec_saved_images": metric(Counter, "ec_connector_saved_images", "Images an encoder instance "
                                          "encoded and saved for a prefill instance."),
                "encoder_fallbacks": metric(Counter, "encoder_fallback", "Images encoded locally because the "
                                            "encoder instance's embeddings were not there (down, failed, or "
                                            "not asked)."),
            }
        # Speculative decoding (only with it), vLLM's names and meaning: request-steps with drafts, draft tokens,
        # accepted ones, and accepted per draft position.
        self.spec = None
        if config.speculative_config is not None:
            self.spec = {
                "spec_num_drafts": metric(Counter, "spec_decode_num_drafts", "Number of spec decoding drafts."),
                "spec_num_draft_tokens": metric(Counter, "spec_decode_num_draft_tokens", "Number of draft tokens."),
                "spec_num_accepted_tokens": metric(Counter, "spec_decode_num_accepted_tokens",
                                                   "Number of accepted tokens."),
            }
            per_pos = Counter(f"{prefix}:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
                              "position.", labels + ["position"], registry=r)
            self.spec_per_pos = [per_pos.labels(**values, position=str(j))
                                 for j in range(config.speculative_config.num_speculative_tokens)]
        # An info metric as a gauge set to 1, as vLLM does: the cache configuration in its labels.
        info = {f.name: str(getattr(config.cache_config, f.name)) for f in dataclasses.fields(config.cache_config)}
        info.update(num_gpu_blocks=str(num_gpu_blocks), engine="0")
        Gauge(f"{prefix}:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=r).labels(**info).set(1)
        # LoRA, as vLLM reports it: the adapters running and waiting in the labels, the time of the report as value.
        self.lora_info = None
        if config.lora_config is not None:
            self.max_lora = str(config.lora_config.max_loras)
            self.lora_info = Gauge(f"{prefix}:lora_requests_info", "Running stats on lora requests.",
                                   ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self._last: SchedulerStats | None = None

    def __call__(self, stats: SchedulerStats | None, iteration: IterationStats) -> None:
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_cache_usage)
            last = self._last
            # The core reports running totals; counters take the growth since the last report.
            self.prefix_queries.inc(stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0))
            self.prefix_hits.inc(stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
            self.preemptions.inc(stats.num_preemptions - (last.num_preemptions if last else 0))
            if self.connector is not None:
                for field_name, counter in self.connector.items():
                    counter.inc(getattr(stats, field_name) - (getattr(last, field_name) if last else 0))
                self.connector_usage.set(stats.kv_storage_usage)
            for group in (self.ec, self.spec):
                for field_name, counter in (group or {}).items():
                    counter.inc(getattr(stats, field_name) - (getattr(last, field_name) if last else 0))
            if self.spec is not None:
                before = last.spec_accepted_per_pos if last else []
                for j, count in enumerate(stats.spec_accepted_per_pos[:len(self.spec_per_pos)]):
                    self.spec_per_pos[j].inc(count - (before[j] if j < len(before) else 0))
            if self.lora_info is not None:
                self.lora_info.labels(max_lora=self.max_lora,
                                      waiting_lora_adapters=",".join(stats.waiting_lora_adapters),
                                      running_lora_adapters=",".join(stats.running_lora_adapters)).set_to_current_time()
            self._last = stats
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        if iteration.num_prompt_tokens or iteration.num_generation_tokens:
            self.iteration_tokens.observe(iteration.num_prompt_tokens + iteration.num_generation_tokens)
        for t in iteration.time_to_first_token:
            self.ttft.observe(t)
        for t in iteration.inter_token_latency:
            self.itl.observe(t)
        for finished in iteration.finished_requests:
            self._observe_finished(finished)

    def _observe_finished(self, f: FinishedRequestStats) -> None:
        self.success[f.finish_reason].inc()
        self.e2e.observe(f.e2e_latency)
        self.queue_time.observe(f.queued_time)
        self.prefill_time.observe(f.prefill_time)
        self.inference_time.observe(f.inference_time)
        self.decode_time.observe(f.decode_time)
        self.request_prompt_tokens.observe(f.num_prompt_tokens)
        self.request_generation_tokens.observe(f.num_generation_tokens)
        self.request_tpot.observe(f.mean_time_per_output_token)
        self.max_num_generation_tokens.observe(f.max_num_generation_tokens)
        self.params_n.observe(f.n)
        if f.max_tokens:
            self.params_max_tokens.observe(f.max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
