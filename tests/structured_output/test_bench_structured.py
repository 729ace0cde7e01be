"""`surge bench structured` end to end on the tiny model (CPU): both runs decode, and the host breakdown per engine
step is printed for each, its phases adding up to the step; the benchmark's wrappers are gone afterwards."""
from __future__ import annotations

import re

from surge.entrypoints.cli.main import main


def test_bench_prints_both_runs_and_a_host_breakdown(tiny_model_dir, capsys):
    from surge.worker import model_runner

    apply_grammar, result = model_runner._apply_grammar, model_runner.PendingOutput.result
    assert main(["bench", "structured", "--model", str(tiny_model_dir), "--device", "cpu", "--batch-size", "3",
                 "--input-len", "6", "--output-len", "5", "--repeats", "1", "--async-scheduling",
                 "--max-model-len", "128", "--kv-cache-memory", str(8 << 20)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"unconstrained: +[0-9.]+ ms per output token step", out)
    assert re.search(r"JSON schema: +[0-9.]+ ms per output token step .*; \d+ of \d+ steps waited", out)
    header = next(line for line in out.splitlines() if line.strip().startswith("step"))
    names = header.split()
    assert names[:2] == ["step", "device"] and names[-1] == "rest"
    applied = {}
    for run in ("unconstrained", "JSON schema"):
        values = [float(v) for v in next(line for line in out.splitlines()
                                         if line.startswith(run) and "per output" not in line)[15:].split()]
        step, phases = values[0], values[1:]
        # The rest closes the sum, up to the printed rounding (half a microsecond per figure).
        assert step > 0 and abs(sum(phases) - step) <= 5e-4 * (len(phases) + 1) + 1e-9
        assert all(v >= 0 for v in phases[:-1])
        applied[run] = values[names.index("apply") - 1]  # "device wait" is two words of the header
    assert applied["unconstrained"] == 0 and applied["JSON schema"] > 0  # masks applied in the constrained run only
    assert model_runner._apply_grammar is apply_grammar and model_runner.PendingOutput.result is result
