"""The benchmarks run end to end on CPU with random-weight presets, and the HF peer really runs the same model."""
from __future__ import annotations

import re

from surge.entrypoints.cli.main import main


def test_throughput_matches_hf_on_preset(capsys):
    assert main(["bench", "throughput", "--preset", "tiny-qwen3-hybrid", "--num-prompts", "6", "--input-len", "40",
                 "--output-len", "12", "--range-ratio", "0.5", "--compare-hf", "--block-size", "8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"surge: .* output tok/s", out)
    assert "greedy outputs identical to HF: 6/6" in out


def test_latency_reports_hardware_rates(capsys):
    assert main(["bench", "latency", "--preset", "tiny-llama", "--batch-sizes", "1,3", "--input-len", "16",
                 "--output-len", "6", "--repeats", "1", "--compare-hf"]) == 0
    out = capsys.readouterr().out
    assert "measured copy bandwidth" in out and "GEMM peak" in out
    assert len(re.findall(r"TFLOP/s \(MFU .*GB/s \(MBU", out)) == 2
    assert "greedy identical: True" in out


def test_unknown_preset_is_refused(capsys):
    assert main(["bench", "latency", "--preset", "gpt-5"]) == 2
    assert "preset='gpt-5' is unknown" in capsys.readouterr().err


def test_parity_reports_identity_and_where_outputs_part(capsys):
    assert main(["bench", "parity", "--preset", "tiny-llama", "--num-prompts", "3", "--input-len", "8",
                 "--input-len-max", "20", "--output-len", "10", "--hf-self-check"]) == 0
    out = capsys.readouterr().out
    assert "greedy outputs identical to HF generate (torch.float32): 3/3" in out
    assert out.count("identical for 10 tokens") == 3 and "noise floor" in out


def test_first_divergence():
    from surge.bench.parity import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
