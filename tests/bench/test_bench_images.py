"""The image workloads of the benchmarks on a tiny LLaVA: `bench serve --image-size --images-per-prompt` sends
distinct random images through Chat and reports images/s with the prompt tokens they add; `bench latency` reports
the vision encoder's time per image; bad image flags are refused by name."""
from __future__ import annotations

import argparse
import json
import re

import pytest

from remote_server import RemoteServer
from surge.bench.serve import make_prompts
from surge.entrypoints.cli.main import main
from tiny_vlm import make_tiny_llava

IMAGE_TOKENS = 16  # the tiny LLaVA's placeholders per image


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("bench-llava"))


def test_bench_serve_image_workload(llava_dir, tmp_path, capsys):
    result = tmp_path / "images.json"
    with RemoteServer(llava_dir, "--served-model-name", "llava", "--max-model-len", "256",
                      "--kv-cache-memory", str(16 << 20)) as server:
        rc = main(["bench", "serve", "--base-url", server.url, "--endpoint", "chat", "--num-prompts", "6",
                   "--input-len", "8", "--output-len", "3", "--image-size", "64x48", "--images-per-prompt", "2",
                   "--max-concurrency", "3", "--result-json", str(result), "--chart", str(tmp_path / "c.png")])
    assert rc == 0
    report = json.loads(result.read_text())
    assert (report["completed"], report["failed"]) == (6, 0), report["errors"]
    assert report["config"]["images_per_prompt"] == 2 and report["config"]["image_size"] == "64x48"
    assert report["image_throughput"] == pytest.approx(12 / report["duration_s"])
    # The server counted each request's image placeholders among its prompt tokens.
    assert all(r["prompt_len"] >= 2 * IMAGE_TOKENS + 8 for r in report["requests"])
    assert report["ttft"]["p50_ms"] > 0
    assert "images/s (2 x 64x48 per request)" in capsys.readouterr().out


def _args(**overrides) -> argparse.Namespace:
    values = dict(num_prompts=3, input_len=4, output_len=2, range_ratio=0.0, vocab_size=256, endpoint="chat",
                  image_size="8x6", images_per_prompt=2, seed=0)
    return argparse.Namespace(**{**values, **overrides})


def test_image_prompts_are_distinct_and_flags_checked():
    prompts = make_prompts(_args())
    urls = [part["image_url"]["url"] for prompt, _, _ in prompts for part in prompt[1:]]
    assert len(urls) == 6 and len(set(urls)) == 6 and all(u.startswith("data:image/jpeg;base64,") for u in urls)
    assert all(prompt[0]["type"] == "text" for prompt, _, _ in prompts)
    for overrides, message in [({"endpoint": "completions"}, "--image-size needs --endpoint chat"),
                               ({"image_size": "1024"}, "--image-size='1024' must be WIDTHxHEIGHT"),
                               ({"image_size": "0x5"}, "must be WIDTHxHEIGHT"),
                               ({"images_per_prompt": 0}, "--images-per-prompt=0 must be >= 1")]:
        with pytest.raises(ValueError, match=message):
            make_prompts(_args(**overrides))


def test_bench_latency_reports_encoder_time_per_image(llava_dir, capsys):
    assert main(["bench", "latency", "--model", str(llava_dir), "--batch-sizes", "1", "--input-len", "16",
                 "--output-len", "3", "--repeats", "1", "--image-size", "64x48", "--max-model-len", "128",
                 "--kv-cache-memory", str(16 << 20)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"encoder: 64x48 image -> 16 tokens: [\d.]+ ms per image at batch 1, [\d.]+ ms per image at "
                     r"batch 8 \([\d.]+ images/s\)", out), out
    assert "TFLOP/s (MFU" in out
