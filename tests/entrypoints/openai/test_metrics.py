"""GET /metrics has vLLM V1's metrics (names, types, labels, bucket boundaries, as vLLM's
vllm/v1/metrics/loggers.py declares them) under Surge's prefix, and exactly vLLM's names with --metrics-prefix vllm;
no `_created` series; request-level metrics count requests, not their n samples."""
from __future__ import annotations

import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from remote_server import RemoteServer
from surge.entrypoints.openai.metrics import check_metrics_prefix

# vLLM V1's /metrics for what Surge has (no sleep mode, KV-connector or multi-modal cache, speculative decoding,
# LoRA, NaN detection, KV-block residency sampling, nor the hidden deprecated ones): name -> type.
VLLM_METRICS = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "cache_config_info": "gauge",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "num_preemptions": "counter",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "request_success": "counter",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "iteration_tokens_total": "histogram",
    "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram",
    "request_params_max_tokens": "histogram",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
}
TOKEN_BUCKETS_512 = [1, 2, 5, 10, 20, 50, 100, 200, 500]  # 1-2-5 up to max_model_len (512 here)
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
TOKEN_LATENCY = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0]
BUCKETS = {
    "request_prompt_tokens": TOKEN_BUCKETS_512,
    "request_generation_tokens": TOKEN_BUCKETS_512,
    "request_max_num_generation_tokens": TOKEN_BUCKETS_512,
    "request_params_max_tokens": TOKEN_BUCKETS_512,
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "request_params_n": [1, 2, 5, 10, 20],
    "time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "inter_token_latency_seconds": TOKEN_LATENCY,
    "request_time_per_output_token_seconds": TOKEN_LATENCY,
    **{name: REQUEST_LATENCY for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                                          "request_inference_time_seconds", "request_prefill_time_seconds",
                                          "request_decode_time_seconds")},
}


def families(server) -> dict:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, suffix: str = "", **labels) -> float:
    return sum(s.value for s in fams[name].samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def vllm_named(tiny_model_dir):
    with RemoteServer(tiny_model_dir, "--served-model-name", "tiny", "--max-model-len", "512", "--kv-cache-memory",
                      str(32 << 20), "--metrics-prefix", "vllm") as server:
        yield server


def check_names_types_labels(fams: dict, prefix: str) -> None:
    assert {name: f.type for name, f in fams.items()} == {f"{prefix}:{n}": t for n, t in VLLM_METRICS.items()}
    for name, f in fams.items():
        for sample in f.samples:
            assert not sample.name.endswith("_created"), sample.name
            assert sample.labels["engine"] == "0", sample
            if not name.endswith("cache_config_info"):
                assert sample.labels["model_name"] == "tiny", sample
    for name, buckets in BUCKETS.items():
        bounds = [float(s.labels["le"]) for s in fams[f"{prefix}:{name}"].samples if s.name.endswith("_bucket")]
        assert bounds == [float(b) for b in buckets] + [math.inf], name
    reasons = {s.labels["finished_reason"] for s in fams[f"{prefix}:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    [info] = fams[f"{prefix}:cache_config_info"].samples
    assert info.value == 1.0 and int(info.labels["num_gpu_blocks"]) > 0 and info.labels["block_size"] == "16"


def test_names_types_labels_and_buckets_under_surge_prefix(tiny_server):
    check_names_types_labels(families(tiny_server), "surge")


def test_vllm_prefix_gives_vllm_names(vllm_named):
    fams = families(vllm_named)
    check_names_types_labels(fams, "vllm")
    assert set(fams) == {f"vllm:{n}" for n in VLLM_METRICS}
    # Counters show with _total, as vLLM's do.
    assert value(fams, "vllm:generation_tokens", "_total") >= 0 and "vllm:generation_tokens_total" in {
        s.name for s in fams["vllm:generation_tokens"].samples}


def test_request_metrics_count_requests_not_samples(vllm_named):
    prompt, n, max_tokens = "count me once", 3, 7
    before = families(vllm_named)
    out = vllm_named.client().completions.create(model="tiny", prompt=prompt, n=n, max_tokens=max_tokens,
                                                 temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in out.choices] == ["length"] * n
    after = families(vllm_named)

    def grew(name: str, suffix: str = "", **labels) -> float:
        return value(after, f"vllm:{name}", suffix, **labels) - value(before, f"vllm:{name}", suffix, **labels)

    assert grew("request_success", "_total", finished_reason="length") == 1  # one request, however many samples
    assert grew("request_success", "_total", finished_reason="stop") == 0
    assert (grew("request_params_n", "_count"), grew("request_params_n", "_sum")) == (1, n)
    assert (grew("request_params_max_tokens", "_count"), grew("request_params_max_tokens", "_sum")) == (1, max_tokens)
    assert grew("request_prompt_tokens", "_sum") == len(prompt.encode())  # byte tokenizer, no BOS
    assert grew("request_generation_tokens", "_sum") == n * max_tokens
    assert grew("request_max_num_generation_tokens", "_sum") == max_tokens
    assert grew("prompt_tokens", "_total") == len(prompt.encode())
    assert grew("generation_tokens", "_total") == n * max_tokens
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "time_to_first_token_seconds"):
        assert grew(name, "_count") == 1, name
    phases = grew("request_prefill_time_seconds", "_sum") + grew("request_decode_time_seconds", "_sum")
    assert phases == pytest.approx(grew("request_inference_time_seconds", "_sum"), abs=1e-6)
    assert grew("request_inference_time_seconds", "_sum") <= grew("e2e_request_latency_seconds", "_sum")
    assert grew("iteration_tokens_total", "_sum") == len(prompt.encode()) + n * max_tokens
    assert grew("inter_token_latency_seconds", "_count") == n * (max_tokens - 1)


def test_bad_metrics_prefix_is_refused():
    with pytest.raises(ValueError, match="metrics_prefix='my-prefix'"):
        check_metrics_prefix("my-prefix")
