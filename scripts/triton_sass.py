"""Compile a Triton kernel for the H100/H200 (sm_90) on a machine without a GPU and summarize its machine code:
registers a thread (how many programs fit an SM), spills, shared memory, and the count of each memory and
synchronization instruction (16-byte LDG.E.128 loads or scalar ones, LDGSTS of a software pipeline, BAR.SYNC of
layout conversions and cross-warp reductions). Triton's wheel ships ptxas and cuobjdump, so this needs no CUDA.

    python scripts/triton_sass.py surge.kernels.fused_moe:_token_down_kernel \\
        --sig a_ptr=*bf16 w_ptr=*bf16 ... N=i32 K=i32 ... --const TOP_K=8 TOP_K_PAD=8 BLOCK_N=4 BLOCK_K=256 ... \\
        [--num-warps 4] [--num-stages 1] [--listing]

Every argument needs a type (--sig NAME=TYPE, Triton's: *bf16, *fp32, *i32, i32, fp32, ...) or a value (--const
NAME=VALUE, its constexprs). Pointers and the integers named stride*, N and K are marked divisible by 16, as the JIT
specializes them at run time for aligned tensors (without that, loads compile to scalar ones). --listing prints the
loads, stores, barriers and branches in program order (are a loop's loads issued together?).
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import tempfile

OPS = r"\b(LDG\.E[\.\w]*|LDGSTS[\.\w]*|LDS[\.\w]*|STS[\.\w]*|STG\.E[\.\w]*|BAR\.SYNC[\.\w]*|SHFL\.\w+|RED[\.\w]*|ATOMG[\.\w]*)"


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", help="module:function of a @triton.jit kernel")
    parser.add_argument("--sig", nargs="+", default=[], help="NAME=TYPE of each runtime argument")
    parser.add_argument("--const", nargs="*", default=[], help="NAME=VALUE of each constexpr")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=1)
    parser.add_argument("--listing", action="store_true")
    args = parser.parse_args()

    import triton
    from triton.backends.compiler import GPUTarget

    module, name = args.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    signature = dict(item.split("=", 1) for item in args.sig)
    constexprs = {k: _value(v) for k, v in (item.split("=", 1) for item in args.const)}
    divisible = [n for n, t in signature.items() if t.startswith("*") or n.startswith("stride") or n in ("N", "K")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = triton.compiler.ASTSource(fn=fn, signature={**signature, **{c: "constexpr" for c in constexprs}},
                                       constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": args.num_warps, "num_stages": args.num_stages})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([f"{tools}/cuobjdump", "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([f"{tools}/cuobjdump", "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    counts: dict[str, int] = {}
    for op in re.findall(OPS, sass):
        counts[op] = counts.get(op, 0) + 1
    registers = re.search(r"REG:(\d+)", usage).group(1)
    stack = re.search(r"STACK:(\d+)", usage).group(1)
    print(f"{name} {constexprs} warps={args.num_warps} stages={args.num_stages}: registers {registers}, stack "
          f"{stack}, shared {compiled.metadata.shared} bytes")
    print("  " + ", ".join(f"{op} {n}" for op, n in sorted(counts.items())))
    if args.listing:
        for line in sass.splitlines():
            op = re.search(r"\b(LDG[\.\w]*|LDGSTS[\.\w]*|STG[\.\w]*|BAR[\.\w]*|BRA|EXIT)\b", line)
            where = re.search(r"/\*([0-9a-f]{4})\*/", line)
            if op and where:
                print(f"  {where.group(1)} {op.group(1)}")


if __name__ == "__main__":
    main()
