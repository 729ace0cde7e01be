"""`surge bench latency --speculative-config`: one command runs the workload with and without speculation and
prints the speed-up, acceptance rate and mean accepted length (greedy outputs compared); --verify-cost prints a
verification step against a decode step. Numbers are printed, never asserted (timing is not a test)."""
from __future__ import annotations

import re

from tiny_dsv import make_tiny_mtp_model
from tiny_models import make_tiny_model

from surge.entrypoints.cli.main import main


def test_latency_with_speculation_prints_the_comparison(tmp_path, capsys):
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    common = ["bench", "latency", "--model", str(model_dir), "--device", "cpu", "--kv-cache-memory", str(1 << 22),
              "--max-model-len", "512", "--batch-sizes", "1,2", "--output-len", "12", "--repeats", "1"]
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    assert main(common + spec + ["--workload", "quote"]) in (0, None)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("batch")]
    assert len(lines) == 2
    for line in lines:
        assert re.search(r"speed-up \d+\.\d\dx \| acceptance rate \d+\.\d%, mean accepted length \d\.\d\d", line)
        assert line.endswith("greedy identical: True")
    assert main(common + spec + ["--verify-cost", "--input-len", "16", "--async-scheduling"]) in (0, None)
    out = capsys.readouterr().out
    assert len(re.findall(r"verification step of k=3 \(\d+ tokens\) +\d+\.\d+ ms: \d+\.\d\dx a decode step", out)) == 2
    # Per batch size, the host's phases of a decode step (async scheduling, then without) and a verification step.
    rows = {name: [float(v) for v in values.split()] for name, values in
            re.findall(r"^  (decode|decode, sync|verify k=3) +([\d. ]+)$", out, re.M)}
    assert set(rows) == {"decode", "decode, sync", "verify k=3"}
    assert len(re.findall(r"^  verify k=3 ", out, re.M)) == 2
    assert rows["verify k=3"][5] > 0 and rows["decode"][5] == 0  # the n-gram lookup: "propose", speculation only


def test_latency_with_a_draft_model_prints_how_its_forwards_ran(tmp_path, capsys):
    """On the CPU (no graphs) every draft forward is eager: one over the step's tokens and k decode passes."""
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    spec = f'{{"method": "draft_model", "model": "{model_dir}", "num_speculative_tokens": 3}}'
    assert main(["bench", "latency", "--model", str(model_dir), "--device", "cpu", "--kv-cache-memory",
                 str(1 << 22), "--max-model-len", "512", "--batch-sizes", "1", "--output-len", "12", "--repeats", "1",
                 "--workload", "quote", "--speculative-config", spec]) in (0, None)
    out = capsys.readouterr().out
    assert "greedy identical: True" in out
    m = re.search(r"draft model per step \((\d+) steps\): step forward 0\.00 graph \+ (\d\.\d\d) eager, decode passes "
                  r"0\.00 graph \+ (\d\.\d\d) eager, host waits (\d\.\d\d)", out)
    assert m and int(m[1]) > 0, out
    assert 1.0 <= float(m[2]) <= 2.0 and float(m[3]) == 3.0 and float(m[4]) <= 1.0


def test_latency_with_deepseek_mtp_prints_the_acceptance_rate(tmp_path, capsys):
    """The MTP layer of a tiny V3 (a copy of its one layer: tests/tiny_dsv.py) as the draft: its acceptance rate,
    and per step its forward over the step's tokens and k - 1 decode passes (eager)."""
    model_dir = make_tiny_mtp_model(tmp_path / "v3", "copy")
    spec = '{"method": "deepseek_mtp", "num_speculative_tokens": 3}'
    assert main(["bench", "latency", "--model", str(model_dir), "--device", "cpu", "--kv-cache-memory",
                 str(1 << 22), "--max-model-len", "256", "--batch-sizes", "1", "--output-len", "12", "--repeats", "1",
                 "--input-len", "16", "--speculative-config", spec]) in (0, None)
    out = capsys.readouterr().out
    assert "speculative decoding: deepseek_mtp, k=3" in out and "greedy identical: True" in out
    rate = re.search(r"acceptance rate (\d+\.\d)%", out)
    assert rate and float(rate[1]) > 0, out
    m = re.search(r"decode passes 0\.00 graph \+ (\d\.\d\d) eager", out)
    assert m and float(m[1]) == 2.0, out
