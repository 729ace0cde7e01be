"""Prometheus metrics for GET /metrics: the engine's load (running and waiting requests, KV cache usage), prefix
cache queries and hits, prompt and generation tokens, and latency histograms (TTFT, inter-token, end to end).

Names follow vLLM's (`surge:` instead of `vllm:`), so dashboards carry over.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from surge.engine.core import SchedulerStats
from surge.engine.output_processor import IterationStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class PrometheusMetrics:
    """A StatsObserver for AsyncLLM; its own registry, so several servers can live in one process (tests)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def bind(metric):
            return metric.labels(model_name=model_name)

        self.running = bind(Gauge("surge:num_requests_running", "Requests in the running batch", labels,
                                  registry=r))
        self.waiting = bind(Gauge("surge:num_requests_waiting", "Requests waiting to be scheduled", labels,
                                  registry=r))
        self.kv_usage = bind(Gauge("surge:kv_cache_usage_perc", "KV cache usage: 1 means every block is in use",
                                   labels, registry=r))
        self.prefix_queries = bind(Counter("surge:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                           "cache", labels, registry=r))
        self.prefix_hits = bind(Counter("surge:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                        labels, registry=r))
        self.preemptions = bind(Counter("surge:num_preemptions", "Requests preempted (recomputed later)", labels,
                                        registry=r))
        self.prompt_tokens = bind(Counter("surge:prompt_tokens", "Prompt tokens of requests that started "
                                          "generating", labels, registry=r))
        self.generation_tokens = bind(Counter("surge:generation_tokens", "Generated tokens", labels, registry=r))
        self.ttft = bind(Histogram("surge:time_to_first_token_seconds", "Time to first token", labels,
                                   buckets=_TTFT_BUCKETS, registry=r))
        self.itl = bind(Histogram("surge:inter_token_latency_seconds", "Time between a sample's tokens", labels,
                                  buckets=_ITL_BUCKETS, registry=r))
        self.e2e = bind(Histogram("surge:e2e_request_latency_seconds", "End-to-end request latency", labels,
                                  buckets=_E2E_BUCKETS, registry=r))
        self._success = Counter("surge:request_success", "Finished samples by finish reason",
                                labels + ["finished_reason"], registry=r)
        self._model_name = model_name
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
            self._last = stats
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for t in iteration.time_to_first_token:
            self.ttft.observe(t)
        for t in iteration.inter_token_latency:
            self.itl.observe(t)
        for t in iteration.e2e_latency:
            self.e2e.observe(t)
        for reason in iteration.finish_reasons:
            self._success.labels(model_name=self._model_name, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
