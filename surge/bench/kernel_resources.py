"""What each attention variant costs the GPU's register file and shared memory, without a GPU:
`python -m surge.bench.kernel_resources [--preset qwen3-8b] [--arch 90] [--num-sms 132]`.

Every variant the warm-up compiles for the preset (per attention kind: the few-token and the general mixed launch,
each decode capture size) is compiled for the target by Triton's own ptxas, and read back with its cuobjdump:
registers per thread, local memory (STACK: register spills), shared memory, and the resident programs per SM each
of them allows. A spill or an occupancy of one or two programs per SM is where to look before spending device time.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch

# Per-SM limits of Hopper (sm_90): registers, shared memory usable by resident programs, resident programs.
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024
SM_MAX_PROGRAMS = 32
# The kernel's arguments that are not 32-bit integers; None: a pointer to the model's dtype.
_ARG_TYPES = {"q_ptr": None, "k_cache_ptr": None, "v_cache_ptr": None, "out_ptr": None, "part_acc_ptr": "*fp32",
              "part_ml_ptr": "*fp32", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
              "query_start_loc_ptr": "*i32", "qk_scale": "fp32", "sinks_ptr": "*fp32", "softcap": "fp32"}
_TRITON_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


@dataclass(frozen=True)
class Resources:
    registers: int  # per thread
    spill_bytes: int  # local memory per thread (cuobjdump's STACK)
    shared_bytes: int
    threads: int

    @property
    def programs_per_sm(self) -> int:
        by_regs = SM_REGISTERS // (self.registers * self.threads) if self.registers else SM_MAX_PROGRAMS
        by_shared = SM_SHARED_BYTES // self.shared_bytes if self.shared_bytes else SM_MAX_PROGRAMS
        return min(by_regs, by_shared, SM_MAX_PROGRAMS)


def parse_resource_usage(text: str) -> tuple[int, int, int]:
    """(REG, STACK, SHARED) of the one function in `cuobjdump -res-usage` output."""
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)", text)
    if m is None:
        raise ValueError(f"no 'REG:.. STACK:.. SHARED:..' line in cuobjdump's output: {text[:300]!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: this Triton has no bundled cuobjdump to read the compiled kernel with")
    return path


def attention_resources(key, arch: int) -> Resources:
    """Compile the attention kernel for `key` (an AttentionKey) for sm_<arch> and read its resource usage."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("kernel_resources compiles for the GPU: run it without TRITON_INTERPRET=1 (the interpreter "
                           "replaces the kernels with Python functions)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from surge.kernels.attention import _paged_attention_kernel, launch_constexprs

    constexprs = launch_constexprs(key)
    options = {name: constexprs.pop(name) for name in ("num_warps", "num_stages")}
    q_type = _TRITON_TYPES[key.dtype]
    names = _paged_attention_kernel.arg_names
    signature = {name: "constexpr" if name in constexprs else _ARG_TYPES.get(name, "i32") or q_type for name in names}
    # As a launch specializes them: every pointer (torch allocations, the q view at offset 0 of the fused qkv
    # projection) and every integer the runtime passes that is a multiple of 16 are known 16-divisible, which is
    # what lets the compiler vectorize the KV loads; the do_not_specialize ones (step-varying) are not.
    ints = _runtime_strides(key)
    divisible = [name for name in names if name not in constexprs and
                 (signature[name].startswith("*") or ints.get(name, 1) % 16 == 0)]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    compiled = triton.compile(ASTSource(_paged_attention_kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    registers, spill = cubin_registers_and_spill(compiled)
    return Resources(registers, spill, compiled.metadata.shared, 32 * options["num_warps"])


def cubin_registers_and_spill(compiled) -> tuple[int, int]:
    """Registers per thread and spilled bytes of a kernel triton.compile built, as cuobjdump reads its cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    registers, spill, _ = parse_resource_usage(out)
    return registers, spill


def _runtime_strides(key) -> dict[str, int]:
    """The strides a model's attention passes for this key's shapes: q a view of the fused qkv output, out
    contiguous, the cache [num_blocks, block_size, kv heads, head_dim]."""
    hq, hkv, d, bs = key.num_q_heads, key.num_kv_heads, key.head_dim, key.block_size
    return dict(stride_qt=(hq + 2 * hkv) * d, stride_qh=d, stride_ot=hq * d, stride_oh=d, stride_cb=bs * hkv * d,
                stride_cs=hkv * d, stride_ch=d)


def attention_variants(preset: str, num_sms: int, max_num_seqs: int) -> list:
    """The preset's attention launch keys as the warm-up makes them (bf16, 16-token cache blocks), distinct."""
    from surge.attention.triton_backend import warm_up_keys
    from surge.kernels.attention import PagedAttention
    from surge.model.loader.base import build_model
    from surge.model.presets import preset_model_config
    from surge.worker.cuda_graph import capture_sizes
    from surge.worker.model_runner import distinct_attention_params

    mc = preset_model_config(preset, "bfloat16", torch.device("cpu"), 4096)
    layers = distinct_attention_params(build_model(mc, torch.device("meta")))
    kernel = PagedAttention(torch.device("cpu"), num_sms)
    keys = warm_up_keys(kernel, layers, 16, torch.bfloat16, capture_sizes(max_num_seqs), max_num_seqs)
    return list(dict.fromkeys(keys))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--num-sms", type=int, default=132, help="SMs the launch policy plans for (H200: 132)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args(argv)
    print(f"attention variants of {args.preset} (bf16) for sm_{args.arch}, {args.num_sms} SMs:")
    print(f"{'launch':<58} {'regs':>5} {'spill B':>8} {'shared B':>9} {'programs/SM':>12}")
    for key in attention_variants(args.preset, args.num_sms, args.max_num_seqs):
        launch = key.launch
        kind = "decode" if launch.decode else ("few-token mixed" if launch.search else "mixed")
        name = (f"{kind}{' sliding' if key.sliding else ''}: m{launch.block_m} n{launch.block_n} "
                f"w{launch.num_warps} s{launch.num_stages} splits {launch.num_splits}")
        r = attention_resources(key, args.arch)
        print(f"{name:<58} {r.registers:>5} {r.spill_bytes:>8} {r.shared_bytes:>9} {r.programs_per_sm:>12}", flush=True)


if __name__ == "__main__":
    main()
