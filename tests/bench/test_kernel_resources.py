"""The device-free resource report compiles each warm-up attention variant for sm_90 with Triton's own ptxas."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from surge.bench import kernel_resources as kr


def test_parse_resource_usage_and_occupancy():
    text = ("Resource usage:\n Common:\n  GLOBAL:11 CONSTANT[4]:8\n Function _paged_attention_kernel:\n"
            "  REG:255 STACK:160 SHARED:1024 LOCAL:0 CONSTANT[0]:664 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert kr.parse_resource_usage(text) == (255, 160, 1024)
    with pytest.raises(ValueError, match="REG"):
        kr.parse_resource_usage("nothing here")
    # 255 x 128 threads: two programs' registers per SM; 96 KB of shared memory: two as well; tiny ones: the cap.
    assert kr.Resources(255, 0, 1024, 128).programs_per_sm == 2
    assert kr.Resources(64, 0, 96 * 1024, 128).programs_per_sm == 2
    assert kr.Resources(32, 0, 0, 32).programs_per_sm == kr.SM_MAX_PROGRAMS


def _run(code: str) -> str:
    """Python in a child without TRITON_INTERPRET (the suite runs kernels in the interpreter; this compiles them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_report_covers_every_warm_up_variant():
    keys = kr.attention_variants("tiny-llama", 132, 8)
    kinds = {(k.launch.decode, k.launch.search > 0) for k in keys}
    assert kinds == {(True, False), (False, True), (False, False)}  # decode sizes, few-token, general mixed
    out = _run("from surge.bench.kernel_resources import main; main(['--preset', 'tiny-llama', '--max-num-seqs', '8'])")
    rows = re.findall(r"^(decode|few-token mixed|mixed)\b.*?\s(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", out, re.M)
    assert len(rows) == len(keys)
    for _, regs, spill, shared, programs in rows:
        assert 0 < int(regs) <= 255 and int(spill) >= 0 and int(shared) > 0 and int(programs) >= 1


def test_runtime_divisibility_is_what_vectorizes_the_kv_loads():
    """Compiled as a launch specializes it (strides known 16-divisible), decode's KV loads are vectorized and nothing
    spills; without that knowledge the same variant loads element by element and takes more registers or spills."""
    out = _run("""
from surge.bench import kernel_resources as kr
key = next(k for k in kr.attention_variants("qwen3-8b", 132, 1) if k.launch.decode)
r = kr.attention_resources(key, 90)
real = kr._runtime_strides
kr._runtime_strides = lambda key: {name: 17 for name in real(key)}  # nothing divisible
blind = kr.attention_resources(key, 90)
print(r.registers, r.spill_bytes, blind.registers, blind.spill_bytes)
""")
    regs, spill, blind_regs, blind_spill = map(int, out.split())
    assert spill == 0 and regs < 200
    assert blind_regs + blind_spill // 4 > regs


def test_refuses_to_run_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    key = kr.attention_variants("tiny-llama", 132, 1)[0]
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET=1"):
        kr.attention_resources(key, 90)
