"""W4A16 at decode on the GPU (`python -m surge.bench.kernels --only int4`): Qwen3-8B's qkv / o / gate_up / down
layers at M = 1 (2 and 4 unless --quick), bf16 cuBLAS beside int4_gemm.int_gemm and the int GEMV (int_gemv.py) at
its launch policy, symmetric (the `--quantization w4a16` preset's) and with zero points, then at M = 1 a sweep of
GEMV launches (the best five shown). GB/s over the bytes each must read: bf16 2 bytes a weight; int4 half a byte plus
the group scales (and zeros). The last lines add the four layers up over 36 layers: the linear layers' share of a
batch-1 decode step for each kernel (the W4A16 target: a step at 1 / 1.6 of bf16's 4.86 ms)."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

HQ, HKV, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 12288  # Qwen3-8B
DTYPE = torch.bfloat16
GROUP = 128
LAYERS = 36
SHAPES = {"qkv": ((HQ + 2 * HKV) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HQ * HEAD_DIM),
          "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}


def _sweep():
    from surge.kernels.int_gemv import IntGemvLaunch

    for block_n, words, stages, split in itertools.product((8, 16, 32, 64), (32, 64, 128), (1, 2, 3), (1, 2)):
        yield IntGemvLaunch(block_n, words // 16, 16, split, 4, stages)
    for block_n, words in itertools.product((32, 64), (64, 128)):  # 8 warps: x slices of 64 / 128 stay "cheap"
        yield IntGemvLaunch(block_n, words // 16, 16, 1, 8, 1)


def check_int4(quick: bool, bench: Callable, report: Callable, max_err: Callable) -> None:
    from surge.kernels import quant_reference as qref
    from surge.kernels.int4_gemm import int_gemm
    from surge.kernels.int_gemv import int_gemv, launch_policy

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    totals: dict[str, float] = {}
    print(f"# W4A16 decode (group {GROUP}; GB/s of the bytes read: int4 packed + scales (+ zeros))")
    for name, (n, k) in SHAPES.items():
        w16 = torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5
        packed = qref.pack_int32(torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8), 4)
        scale = (torch.rand(n, k // GROUP, device="cuda") * 0.02 + 0.001).to(DTYPE)
        zero = torch.randint(0, 16, (n, k // GROUP), device="cuda", dtype=torch.uint8)
        int4_bytes = n * k // 2 + n * (k // GROUP) * 2
        for m in (1,) if quick else (1, 2, 4):
            tag = f"{name} {n}x{k} M={m}"
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            seconds = bench(lambda: x @ w16.t())
            report(f"bf16 cuBLAS {tag}", seconds, nbytes=2 * n * k)
            totals[f"bf16 cuBLAS M={m}"] = totals.get(f"bf16 cuBLAS M={m}", 0.0) + seconds
            for zeros in (None, zero):
                kind = "sym" if zeros is None else "zp"
                nbytes = int4_bytes + (0 if zeros is None else n * (k // GROUP))
                expected = qref.int_gemm(x.float(), packed, scale.float(), 4, GROUP, zeros)
                for label, fn in (("int_gemm", int_gemm), ("int_gemv", int_gemv)):
                    got = fn(x, packed, scale, bits=4, group_size=GROUP, zero_point=zeros)
                    seconds = bench(lambda fn=fn: fn(x, packed, scale, bits=4, group_size=GROUP, zero_point=zeros))
                    extra = str(launch_policy(m, n, k, GROUP, 4, sms)) if label == "int_gemv" else ""
                    report(f"w4a16 {label} {kind} {tag}", seconds, nbytes=nbytes, err=max_err(got, expected),
                           tol=2e-2, extra=extra)
                    if zeros is None:
                        totals[f"{label} M={m}"] = totals.get(f"{label} M={m}", 0.0) + seconds
            if m != 1:
                continue
            times = []
            for launch in _sweep():
                try:
                    times.append((bench(lambda lc=launch: int_gemv(x, packed, scale, bits=4, group_size=GROUP,
                                                                   launch=lc)), launch))
                except Exception as e:  # a launch the compiler refuses (registers, shared memory): named, skipped
                    print(f"  {launch}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            expected = qref.int_gemm(x.float(), packed, scale.float(), 4, GROUP)
            for seconds, launch in sorted(times, key=lambda t: t[0])[:5]:
                got = int_gemv(x, packed, scale, bits=4, group_size=GROUP, launch=launch)
                report(f"w4a16 int_gemv sym {tag} {launch}", seconds, nbytes=int4_bytes,
                       err=max_err(got, expected), tol=2e-2)
    for label, seconds in totals.items():
        bf16 = totals[f"bf16 cuBLAS {label.split()[-1]}"]
        print(f"# {LAYERS} layers' linears, {label}: {seconds * LAYERS * 1e3:.2f} ms a step "
              f"({bf16 / seconds:.2f}x bf16's speed)", flush=True)
