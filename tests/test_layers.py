"""Dependencies point down: import-linter's layers contract in pyproject.toml ([tool.importlinter]) holds, so a
new upward import fails here with a message naming the importing module, the imported one and the line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layers_contract_is_kept():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.is_file(), f"{lint_imports} is missing: install requirements/test.txt (import-linter)"
    # No cache: a stale one in the working tree could hide a new import.
    proc = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"lint-imports failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
