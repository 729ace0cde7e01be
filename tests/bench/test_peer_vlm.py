"""scripts/peer_vlm.py (vLLM on the image workload, run on the GPU machine) builds the very requests `surge bench serve
--endpoint chat --image-size` sends: same words, lengths, image pixels (JPEG bytes) and chat messages, and the same
percentiles. Its vLLM half runs only there."""
from __future__ import annotations

import argparse
import base64
import importlib.util
from pathlib import Path

import pytest

from surge.bench.serve import _WORDS, _summary, make_prompts

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "peer_vlm.py"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("peer_vlm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_requests_equal_bench_serve_ones(peer):
    assert peer.WORDS == _WORDS
    args = argparse.Namespace(num_prompts=4, input_len=6, output_len=5, range_ratio=0.5, vocab_size=32000,
                              endpoint="chat", image_size="40x24", images_per_prompt=2, seed=7)
    theirs = make_prompts(args)
    ours = peer.make_requests(4, 6, 5, (40, 24), images_per_prompt=2, range_ratio=0.5, seed=7)
    assert len({n for _, _, n in ours}) > 1  # the ranged lengths are exercised
    for (text, jpegs, n_out), (parts, _, their_out) in zip(ours, theirs, strict=True):
        assert (text, n_out) == (parts[0]["text"], their_out)
        sent = [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]) for p in parts[1:]]
        assert jpegs == sent
        assert peer.chat_messages(text, jpegs) == [{"role": "user", "content": parts}]


def test_percentiles_equal_bench_serve_ones(peer):
    values = [0.31, 0.02, 0.5, 0.11, 0.07, 0.9, 0.4]
    assert peer.summary_ms(values) == pytest.approx(_summary(values))
    assert peer.summary_ms([]) == _summary([])


def test_arguments(peer):
    args = peer.parse_args(["/dir", "--concurrency", "1,32", "--num-prompts", "16,128", "--image-size", "1024x768"])
    assert (args.concurrency, args.num_prompts, args.image_size, args.path) == ([1, 32], [16, 128], (1024, 768),
                                                                                "chat")
    with pytest.raises(SystemExit):
        peer.parse_args(["/dir", "--concurrency", "1,32", "--num-prompts", "16"])
