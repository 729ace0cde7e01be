"""Multi-LoRA kernels on the GPU (`python -m surge.bench.kernels --only lora`): Qwen3-8B's four adapted projection
groups (q/k/v, o, gate/up, down; rank 16, 8 adapter slots, bfloat16) at decode sizes (1 token of one adapter; 8 and 64
tokens over 8 adapters) and a 2048-token prefill (16 segments of 128 tokens, 8 adapters round robin), each timed as
the kernels before issue 30's rework ("old": a split-K shrink and an expand, one grid over every max_loras group) and
now (surge/kernels/lora.py: the policy's launch, and at decode sizes the fused and the split paths both), in us and
GB/s of the bytes the step must move: x and y read, y written, each live adapter's A and B read once.
Without a GPU, `python -m surge.bench.kernels_lora` compiles each variant for sm_90 and prints its registers, spills,
shared memory and stores (y's rows should be 16-byte vectors).
"""
# The old kernels are kept here, unchanged from commit 8d73cb6, only as this benchmark's baseline.
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import triton
import triton.language as tl

DECODE_MAX_TOKENS = 64


SPLIT_K_CHUNK = 256  # a decode-sized shrink's `in` columns per program
MAX_SPLIT_K = 32  # the expand adds up to this many partials per tile it loads


@dataclass(frozen=True)
class LoRALaunch:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 1


@lru_cache(maxsize=1024)  # an eager step asks once per layer: the answer is the same for every layer of a shape
def shrink_policy(num_tokens: int, n: int, k: int) -> LoRALaunch:
    """x [num_tokens, k] times A^T [k, n] (n = slices * rank: 16..192); decode-sized: split-K by 256 columns."""
    block_m = 16 if num_tokens <= DECODE_MAX_TOKENS else 64
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(128 if block_m == 16 else 64, triton.next_power_of_2(k)))
    split_k = min(MAX_SPLIT_K, triton.cdiv(k, SPLIT_K_CHUNK)) if block_m == 16 else 1
    return LoRALaunch(block_m, block_n, block_k, 4, split_k)


def shrink_buffer(num_tokens: int, n: int, k: int, device: torch.device) -> torch.Tensor:
    """The shrink's output for x [num_tokens, k] and n = slices * rank: [num_tokens, split_k, n] float32 partial
    sums (the expand adds them)."""
    return torch.empty(num_tokens, shrink_policy(num_tokens, n, k).split_k, n, dtype=torch.float32, device=device)


@lru_cache(maxsize=1024)
def expand_policy(num_tokens: int, slice_size: int, rank: int) -> LoRALaunch:
    """s [num_tokens, rank] times B^T [rank, slice_size], added into y: the whole rank in one k step."""
    block_m = 16 if num_tokens <= DECODE_MAX_TOKENS else 64
    block_n = max(16, min(128 if block_m == 16 else 64, triton.next_power_of_2(slice_size)))
    return LoRALaunch(block_m, block_n, max(16, triton.next_power_of_2(rank)), 4)


@triton.jit
def _group_rows(sorted_ptr, slot_ptr, start_ptr, len_ptr, group, pid_m, BLOCK_M: tl.constexpr):
    """The slot of `group` and the token rows of its pid_m-th tile (mask: rows that exist); slot < 0: nothing."""
    slot = tl.load(slot_ptr + group)
    count = tl.load(len_ptr + group)
    start = tl.load(start_ptr + group)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    rows = tl.load(sorted_ptr + start + offs, mask=mask, other=0).to(tl.int64)
    return slot, count, rows, mask


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, s_ptr, sorted_ptr, slot_ptr, start_ptr, len_ptr, n, k, k_per_split, stride_x,
                   stride_as, stride_an, stride_s, stride_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    group = tl.program_id(1)
    split = tl.program_id(2)
    num_n = tl.cdiv(n, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    slot, count, rows, mask_m = _group_rows(sorted_ptr, slot_ptr, start_ptr, len_ptr, group, pid_m, BLOCK_M)
    if slot < 0 or pid_m * BLOCK_M >= count:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, k), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k
        xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)
        at = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None], mask=mask_n[None, :] & mask_k[:, None],
                     other=0.0)
        acc += tl.dot(xt, at, input_precision="ieee")
    tl.store(s_ptr + rows[:, None] * stride_s + split * stride_split + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, offsets_ptr, sorted_ptr, slot_ptr, start_ptr, len_ptr, rank, max_size,
                   stride_s, stride_split, stride_bs, stride_bn, stride_y, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.program_id(1)  # the slice
    group = tl.program_id(2)
    num_n = tl.cdiv(max_size, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    slot, count, rows, mask_m = _group_rows(sorted_ptr, slot_ptr, start_ptr, len_ptr, group, pid_m, BLOCK_M)
    if slot < 0 or pid_m * BLOCK_M >= count:
        return
    first = tl.load(offsets_ptr + j)
    size = tl.load(offsets_ptr + j + 1) - first
    if pid_n * BLOCK_N >= size:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < size
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < rank
    s_tile = s_ptr + rows[:, None] * stride_s + j * rank + offs_k[None, :]
    mask_s = mask_m[:, None] & mask_k[None, :]
    st = tl.load(s_tile, mask=mask_s, other=0.0)
    for split in tl.static_range(1, SPLIT_K):  # the shrink's partial sums
        st += tl.load(s_tile + split * stride_split, mask=mask_s, other=0.0)
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + (first + offs_n[None, :]) * stride_bn + offs_k[:, None],
                 mask=mask_n[None, :] & mask_k[:, None], other=0.0)
    if bt.dtype == tl.float32 or BLOCK_M < 64:
        delta = tl.dot(st, bt.to(tl.float32), input_precision="ieee")
    else:  # prefill tiles on tensor cores: s rounded to the adapter's dtype, as PEFT's lora_B(lora_A(x)) computes in
        # it. (H200, Qwen3-8B, 8 adapters of rank 16: offline 0.683 -> 0.728 of the base; decode-sized tiles stay in
        # float32 FMA, 0.35 ms a batch-1 step faster there.)
        delta = tl.dot(st.to(bt.dtype), bt)
    y_tile = y_ptr + rows[:, None] * stride_y + first + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, s: torch.Tensor, sorted_tokens: torch.Tensor,
                slot_ids: torch.Tensor, group_start: torch.Tensor, group_len: torch.Tensor) -> None:
    """s[t, i, :] = the i-th split's share of x[t] @ a[slot of t]^T, for every grouped token t (x [T, k], a [L, n, k],
    s [T, split_k, n] float32 from shrink_buffer); rows of tokens in no group are left as they are."""
    num_tokens, k = x.shape
    n = a.shape[1]
    p = shrink_policy(num_tokens, n, k)
    assert s.shape == (num_tokens, p.split_k, n), (s.shape, p)
    k_per_split = triton.cdiv(triton.cdiv(k, p.split_k), p.block_k) * p.block_k
    grid = (triton.cdiv(num_tokens, p.block_m) * triton.cdiv(n, p.block_n), slot_ids.shape[0], p.split_k)
    _shrink_kernel[grid](x, a, s, sorted_tokens, slot_ids, group_start, group_len, n, k, k_per_split, x.stride(0),
                         a.stride(0), a.stride(1), s.stride(0), s.stride(1), BLOCK_M=p.block_m, BLOCK_N=p.block_n,
                         BLOCK_K=p.block_k, num_warps=p.num_warps)


def lora_expand(s: torch.Tensor, b: torch.Tensor, y: torch.Tensor, slice_offsets: torch.Tensor, max_slice: int,
                sorted_tokens: torch.Tensor, slot_ids: torch.Tensor, group_start: torch.Tensor,
                group_len: torch.Tensor) -> None:
    """y[t, o_j:o_j+1] += s[t, j*r:(j+1)*r] @ b[slot of t, o_j:o_j+1]^T for every grouped token t and slice j
    (slice_offsets: [slices + 1] int32 output offsets o_j; s [T, split_k, slices * r] float32 partial sums, b
    [L, out, r])."""
    num_tokens = s.shape[0]
    rank = b.shape[2]
    p = expand_policy(num_tokens, max_slice, rank)
    grid = (triton.cdiv(num_tokens, p.block_m) * triton.cdiv(max_slice, p.block_n), slice_offsets.shape[0] - 1,
            slot_ids.shape[0])
    _expand_kernel[grid](s, b, y, slice_offsets, sorted_tokens, slot_ids, group_start, group_len, rank, max_slice,
                         s.stride(0), s.stride(1), b.stride(0), b.stride(1), y.stride(0), BLOCK_M=p.block_m,
                         BLOCK_N=p.block_n, BLOCK_K=p.block_k, SPLIT_K=s.shape[1], num_warps=p.num_warps)


GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (12288, 12288)),
          "down": (12288, (4096,))}  # in_features, output slices (Qwen3-8B)
RANK, MAX_LORAS, DTYPE = 16, 8, torch.bfloat16


def _token_slots(num_tokens: int) -> np.ndarray:
    """1 token: one adapter; decode sizes: adapters round robin per token; a prefill: 128-token segments."""
    if num_tokens == 1:
        return np.zeros(1, dtype=np.int64)
    segment = 1 if num_tokens <= DECODE_MAX_TOKENS else 128
    return (np.arange(num_tokens) // segment) % MAX_LORAS


def check_lora(bench: Callable, report: Callable, max_err: Callable,
               batches: tuple[int, ...] = (1, 8, 64, 2048), device: str = "cuda") -> None:
    from surge.kernels.lora import lora_add, lora_policy
    from surge.model.layers.lora import LoRAMapping

    print(f"# Multi-LoRA, rank {RANK}, {MAX_LORAS} slots, bf16 (GB/s: x, A and B of the live adapters, y read+written)")
    for name, (k, sizes) in GROUPS.items():
        out = sum(sizes)
        offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        slices = tuple(zip(offsets, sizes))
        slice_offsets = torch.tensor(offsets + [out], dtype=torch.int32, device=device)
        a = torch.randn(MAX_LORAS, len(sizes) * RANK, k, device=device, dtype=DTYPE) / k ** 0.5
        b = torch.randn(MAX_LORAS, out, RANK, device=device, dtype=DTYPE) * 0.1
        for m in batches:
            token_slot = _token_slots(m)
            mapping = LoRAMapping(m, MAX_LORAS, torch.device(device), use_kernels=True)
            mapping.set_tokens(token_slot)
            groups = (mapping.sorted_tokens, mapping.slot_ids, mapping.group_start, mapping.group_len)
            x = torch.randn(m, k, device=device, dtype=DTYPE)
            y0 = torch.randn(m, out, device=device, dtype=DTYPE)
            live = len(set(token_slot.tolist()))
            nbytes = (m * k + 2 * m * out + live * (len(sizes) * RANK * k + out * RANK)) * 2
            # reference: float32 per adapter
            want = y0.float().clone()
            for slot in set(token_slot.tolist()):
                rows = torch.from_numpy(np.flatnonzero(token_slot == slot)).to(device)
                s = x[rows].float() @ a[slot].float().t()
                for j, (o, size) in enumerate(slices):
                    want[rows, o:o + size] += s[:, j * RANK:(j + 1) * RANK] @ b[slot, o:o + size].float().t()
            y = y0.clone()

            def old():
                s = shrink_buffer(m, a.shape[1], k, x.device)
                lora_shrink(x, a, s, *groups)
                lora_expand(s, b, y, slice_offsets, max(sizes), *groups)

            policy = lora_policy(m, MAX_LORAS, k, sizes, RANK, 2)
            launches = {"new": policy}
            if m <= DECODE_MAX_TOKENS:  # both paths, whichever the policy picks
                other = lora_policy(m, MAX_LORAS, k, sizes, RANK, 2, fused=not policy.fused)
                launches["new (fused)" if other.fused else "new (split)"] = other
            tag = f"lora {name} M={m} adapters={live}"
            y.copy_(y0)
            old()
            err = max_err(y, want)  # before the timing, which adds the deltas again and again
            report(f"{tag} old", bench(old), nbytes=nbytes, err=err, tol=2e-2)
            for label, launch in launches.items():
                def new(launch=launch):
                    lora_add(x, a, b, y, slice_offsets, slices, *groups, launch=launch)

                y.copy_(y0)
                new()
                err = max_err(y, want)
                extra = "fused" if launch.fused else f"split_k {launch.split_k}"
                report(f"{tag} {label}", bench(new), nbytes=nbytes, err=err, tol=2e-2,
                       extra=f"({extra}, {launch.tiles_per_program} col tiles/program)")


def recorded_launches(num_tokens: int, in_features: int, sizes: tuple[int, ...], dtype: torch.dtype = DTYPE,
                      rank: int = RANK, fused: bool | None = None) -> list[tuple[object, dict, dict]]:
    """The Triton launches lora_add makes for this step, recorded, not run (tensors on the meta device): each as
    (the @triton.jit kernel, its arguments by name, launch options)."""
    from surge.kernels import lora as kernels

    out = sum(sizes)
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    meta = torch.device("meta")
    calls = []

    class Recorder:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, num_warps: int, num_stages: int = 3, **constexprs):
                values = dict(zip(self.kernel.arg_names, args)) | constexprs
                calls.append((self.kernel, values, {"num_warps": num_warps, "num_stages": num_stages}))
            return launch

    real = kernels._shrink_kernel, kernels._expand_kernel
    kernels._shrink_kernel, kernels._expand_kernel = Recorder(real[0]), Recorder(real[1])
    try:
        groups = [torch.zeros(MAX_LORAS, dtype=torch.int32, device=meta) for _ in range(3)]
        launch = kernels.lora_policy(num_tokens, MAX_LORAS, in_features, sizes, rank, dtype.itemsize, fused)
        kernels.lora_add(torch.empty(num_tokens, in_features, dtype=dtype, device=meta),
                         torch.empty(MAX_LORAS, len(sizes) * rank, in_features, dtype=dtype, device=meta),
                         torch.empty(MAX_LORAS, out, rank, dtype=dtype, device=meta),
                         torch.empty(num_tokens, out, dtype=dtype, device=meta),
                         torch.empty(len(sizes) + 1, dtype=torch.int32, device=meta), tuple(zip(offsets, sizes)),
                         torch.empty(num_tokens, dtype=torch.int32, device=meta), *groups, launch=launch)
    finally:
        kernels._shrink_kernel, kernels._expand_kernel = real
    return calls


@dataclass(frozen=True)
class Compiled:
    registers: int
    spill_bytes: int
    shared_bytes: int
    vector_stores: int  # 16-byte st.global.v4 in the PTX (y's rows in the expand)
    scalar_stores: int  # every other st.global


def compile_launch(kernel, values: dict, options: dict, arch: int = 90) -> Compiled:
    """Compile one recorded launch for sm_<arch> as the launch would specialize it (pointers and multiples of 16
    known 16-divisible, do_not_specialize arguments not), with Triton's own ptxas; read back its resources."""
    import os
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from surge.bench.kernel_resources import cubin_registers_and_spill

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_launch compiles for the GPU: run it without TRITON_INTERPRET=1")
    types = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32"}
    loose = set(kernel.do_not_specialize or ())
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        signature[name] = types[value.dtype] if isinstance(value, torch.Tensor) else "i32"
        if isinstance(value, torch.Tensor) or (value % 16 == 0 and name not in loose and i not in loose):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    registers, spill = cubin_registers_and_spill(compiled)
    ptx = compiled.asm["ptx"]
    vector = len(re.findall(r"st\.global[.\w:]*\.v4", ptx))
    return Compiled(registers, spill, compiled.metadata.shared, vector, len(re.findall(r"st\.global", ptx)) - vector)


def main() -> None:
    """`python -m surge.bench.kernels_lora`: without a GPU, each LoRA kernel variant of Qwen3-8B's groups compiled
    for sm_90: registers, spills, shared memory and stores (y's rows should be 16-byte vectors)."""
    print(f"{'LoRA launch (bf16, rank 16)':<44} {'regs':>5} {'spill B':>8} {'shared B':>9} {'st.v4':>6} {'st':>4}")
    for name, (k, sizes) in GROUPS.items():
        for m in (1, 17, 65, 2048):
            for kernel, values, options in recorded_launches(m, k, sizes):
                c = compile_launch(kernel, values, options)
                path = "fused" if values.get("FUSED") else kernel.__name__.strip("_").replace("_kernel", "")
                print(f"{f'{name} M={m} {path}':<44} {c.registers:>5} {c.spill_bytes:>8} {c.shared_bytes:>9} "
                      f"{c.vector_stores:>6} {c.scalar_stores:>4}", flush=True)


if __name__ == "__main__":
    main()
