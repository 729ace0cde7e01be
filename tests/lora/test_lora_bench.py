"""`surge bench throughput|latency --num-lora-adapters N`: random adapters written for the preset, the workload run
with and without them in one engine, both figures and their ratio printed; the adapters really change outputs."""
from __future__ import annotations

import argparse
import re

import pytest

from surge.bench.lora import add_lora_bench_args, resolve_lora_args
from surge.engine.args import EngineArgs
from surge.entrypoints.cli.main import main


def test_throughput_with_adapters_prints_both_and_the_ratio(capsys):
    assert main(["bench", "throughput", "--preset", "tiny-llama", "--num-prompts", "6", "--input-len", "8",
                 "--output-len", "8", "--num-lora-adapters", "3", "--lora-rank", "4"]) == 0
    out = capsys.readouterr().out
    assert "3 random rank-4 LoRA adapters on q/k/v/o/gate/up/down" in out
    assert re.search(r"surge base: .* output tok/s", out) and re.search(r"surge lora3: .* output tok/s", out)
    m = re.search(r"ratio lora3 / base: [0-9.]+ output tok/s; a full step reads 3 adapter\(s\).*differ from the base "
                  r"model's: (\d+)/6", out)
    assert m and int(m.group(1)) > 0  # the adapters are applied


def test_latency_with_adapters_one_per_request_round_robin(capsys):
    # Decode time is (full run - prefill-only run) / (output - 1): 16 tokens, best of 2, so that a loaded CI machine's
    # noise cannot make it negative (with 4 tokens and one repeat it did, on a machine at load 5 on 2 cores).
    assert main(["bench", "latency", "--preset", "tiny-llama", "--batch-sizes", "1,4", "--input-len", "8",
                 "--output-len", "16", "--repeats", "2", "--num-lora-adapters", "3", "--lora-rank", "4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"batch    1 lora1 .* GB read per step, [0-9.]+ MB of it adapters", out)
    assert re.search(r"batch    4 lora3 .*decode .* tok/s", out)
    assert re.search(r"batch 1 ratio lora1 / base \(decode tok/s\): [0-9.]+", out)
    assert re.search(r"batch 4 ratio lora3 / base \(decode tok/s\): [0-9.]+", out)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    add_lora_bench_args(p)
    args = p.parse_args(list(argv))
    resolve_lora_args(args)
    return args


def test_engine_flags_follow_the_adapters_unless_given():
    args = _args("--num-lora-adapters", "8", "--lora-rank", "32")
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 8, 32)
    args = _args("--num-lora-adapters", "8", "--max-loras", "2", "--max-lora-rank", "64")
    assert (args.max_loras, args.max_lora_rank) == (2, 64)
    args = _args()  # no adapters: the engine's defaults, LoRA off
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (False, 1, 16)
    assert EngineArgs.from_cli_args(args).create_lora_config() is None
    with pytest.raises(ValueError, match="--lora-rank=0"):
        _args("--num-lora-adapters", "2", "--lora-rank", "0")
