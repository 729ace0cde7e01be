"""`python -m surge.bench.kernels --only lora` on small shapes under the interpreter: every case (the old kernels, the
policy's launch, the other path at decode sizes) runs and matches the float32 reference before it is timed on a
GPU."""
from __future__ import annotations


def test_lora_kernel_bench_runs_every_case(device, require_bf16_dot, monkeypatch, capsys):
    from surge.bench import kernels as bench_kernels
    from surge.bench import kernels_lora

    monkeypatch.setattr(kernels_lora, "GROUPS", {"qkv": (64, (32, 16, 16)), "down": (96, (32,))})
    monkeypatch.setattr(bench_kernels, "failures", [])
    kernels_lora.check_lora(lambda fn: 1e-6, bench_kernels.report, bench_kernels.max_err, (1, 8, 70),
                            device=str(device))
    out = capsys.readouterr().out
    assert bench_kernels.failures == [], out
    for group in ("qkv", "down"):
        for tag in ("M=1 adapters=1 old", "M=1 adapters=1 new ", "M=1 adapters=1 new (split)",
                    "M=8 adapters=8 new (split)", "M=70 adapters=1 new "):
            assert f"lora {group} {tag}" in out, (group, tag, out)
    assert "M=70 adapters=1 new (" not in out  # prefill sizes: the policy's path only
