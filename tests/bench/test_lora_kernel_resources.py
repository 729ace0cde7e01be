"""The LoRA kernels compiled for sm_90 without a GPU (Triton's own ptxas), as each path of the launch policy launches
them at Qwen3-8B's q/k/v: nothing spills, shared memory fits an SM, and the expand adds into y with 16-byte vector
stores only (its column offset and width known multiples of 8; element-wise stores made the old expand 3x slow)."""
from __future__ import annotations

import os
import subprocess
import sys


def _run(code: str) -> str:
    """Python in a child without TRITON_INTERPRET (the suite runs kernels in the interpreter; this compiles them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_each_path_compiles_without_spills_and_stores_y_as_vectors():
    out = _run("""
from surge.bench.kernels_lora import GROUPS, compile_launch, recorded_launches
k, sizes = GROUPS["qkv"]
for m in (1, 17, 2048):
    for kernel, values, options in recorded_launches(m, k, sizes):
        c = compile_launch(kernel, values, options)
        print(m, kernel.__name__, int(values.get("FUSED", 0)), c.spill_bytes, c.shared_bytes, c.vector_stores,
              c.scalar_stores)
""")
    rows = [line.split() for line in out.strip().splitlines()]
    assert [(m, name, fused) for m, name, fused, *_ in rows] == [
        ("1", "_expand_kernel", "1"), ("17", "_shrink_kernel", "0"), ("17", "_expand_kernel", "0"),
        ("2048", "_shrink_kernel", "0"), ("2048", "_expand_kernel", "0")]
    for m, name, _, spill, shared, vector, scalar in rows:
        assert int(spill) == 0 and int(shared) <= 227 * 1024, (m, name, spill, shared)
        if name == "_expand_kernel":
            assert int(vector) > 0 and int(scalar) == 0, (m, vector, scalar)
