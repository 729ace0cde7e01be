"""`surge bench startup` end to end on CPU: it writes the preset's checkpoint, measures a cold (disk) and a warm
(daemon) engine process side by side, checks parity, and stops the daemons it started."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from surge.entrypoints.cli.main import main


def test_startup_cold_against_warm(tmp_path, capsys):
    checkpoint = tmp_path / "tiny-llama"
    assert main(["bench", "startup", "--preset", "tiny-llama", "--checkpoint-dir", str(checkpoint), "--device", "cpu",
                 "--max-model-len", "256", "--kv-cache-memory", str(1 << 22), "--parity", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint: preset tiny-llama in {checkpoint}" in out
    number = r"\s+\d+\.\d+ s\s+[\d.]+ GB/s\s+\d+\.\d+ s\s+\d+\.\d+ s"
    assert re.search(r"cold \(disk\)" + number, out), out
    assert re.search(r"warm \(daemon\)" + number, out), out
    assert "parity: the daemon's tensors equal a disk load" in out
    rows = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"^(\S.*?)\s{2,}(\d+\.\d+) s\s+(\d+\.\d+) s$", out, re.M)}
    names = ["interpreter + imports", "CUDA context", "weights", "KV cache allocation", "kernel warm-up",
             "CUDA graph capture", "engine, other", "first step"]
    assert set(names) | {"first token"} <= set(rows), out
    for side in (0, 1):  # the phases account for the whole time to the first token (each rounded to 0.01 s)
        assert abs(sum(rows[n][side] for n in names) - rows["first token"][side]) < 0.05, out
    socket_dir = re.search(r"weight-cache daemons \(sockets in (\S+)\) ready", out).group(1)
    assert not Path(socket_dir).exists()  # the daemons it started are gone, and their directory


def test_preset_needs_a_checkpoint_dir(capsys):
    assert main(["bench", "startup", "--preset", "tiny-llama", "--device", "cpu"]) == 2
    assert "--preset needs --checkpoint-dir" in capsys.readouterr().err


def test_engine_start_up_path_imports_no_transformers():
    """The engine core's imports leave out transformers (~1 s): only the tokenizer of a constrained request needs it."""
    code = ("import sys; import surge.engine.core, surge.bench.startup; "
            "print(sorted(m for m in ('transformers', 'triton', 'llguidance.hf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
