"""`surge bench serve` against a live server on a tiny model: every request completes with the asked lengths,
the JSON result and the PNG chart are written; percentiles match numpy's."""
from __future__ import annotations

import json

import numpy as np
import pytest

from surge.bench.serve import RequestResult, _summary, parse_goodput, summarize
from surge.entrypoints.cli.main import main


def test_bench_serve_end_to_end(tiny_server, tmp_path, capsys):
    result, chart = tmp_path / "result.json", tmp_path / "chart.png"
    rc = main(["bench", "serve", "--base-url", tiny_server.url, "--api-key", tiny_server.api_key,
               "--num-prompts", "12", "--input-len", "32", "--output-len", "8", "--range-ratio", "0.5",
               "--vocab-size", "256", "--request-rate", "200", "--max-concurrency", "4",
               "--goodput", "ttft:60000", "tpot:60000", "--result-json", str(result), "--chart", str(chart)])
    assert rc == 0
    report = json.loads(result.read_text())
    assert report["model"] == "tiny"
    assert (report["completed"], report["failed"]) == (12, 0)
    requests = report["requests"]
    assert report["output_len_mismatches"] == 0
    assert [r["output_len"] for r in requests] == [r["expected_output_len"] for r in requests]
    assert report["total_output_tokens"] == sum(r["output_len"] for r in requests)
    assert all(4 <= r["output_len"] <= 12 and 16 <= r["prompt_len"] <= 48 for r in requests)
    assert report["goodput"]["good_requests"] == 12
    for key in ("ttft", "tpot", "itl", "e2e"):
        assert 0 < report[key]["p50_ms"] <= report[key]["p99_ms"]
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT" in capsys.readouterr().out


def test_chat_endpoint(tiny_server, tmp_path):
    result = tmp_path / "chat.json"
    main(["bench", "serve", "--base-url", tiny_server.url, "--api-key", tiny_server.api_key, "--endpoint", "chat",
          "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--result-json", str(result),
          "--chart", str(tmp_path / "chat.png")])
    report = json.loads(result.read_text())
    assert (report["completed"], report["total_output_tokens"]) == (4, 16)


def test_percentiles_match_numpy():
    values = [0.003, 0.1, 0.02, 0.5, 0.07, 0.011, 0.9]
    s = _summary(values)
    for key, q in (("p50_ms", 50), ("p90_ms", 90), ("p99_ms", 99)):
        assert s[key] == pytest.approx(np.percentile(values, q) * 1000)
    assert s["mean_ms"] == pytest.approx(np.mean(values) * 1000)


def test_goodput_counts_requests_meeting_every_slo():
    results = [RequestResult(10, 11, output_len=11, ttft=0.1, e2e=1.1),
               RequestResult(10, 11, output_len=11, ttft=0.3, e2e=1.3),
               RequestResult(10, 11, output_len=11, ttft=0.1, e2e=3.1),
               RequestResult(10, 11, error="HTTP 500")]
    s = summarize(results, 2.0, parse_goodput(["ttft:200", "tpot:150"]))
    assert s["goodput"]["good_requests"] == 1  # the 2nd misses TTFT, the 3rd TPOT (0.3 s), the 4th failed
    assert (s["completed"], s["failed"]) == (3, 1)
    with pytest.raises(ValueError, match="unknown key"):
        parse_goodput(["latency:5"])
