"""Multi-LoRA in Triton: the shrink (s = x @ A[slot]^T, [T, in] -> [T, slices * r]) and the expand (y[:, slice j] +=
s[:, j-th r columns] @ B[slot, slice j rows]^T) of a layer's adapters, every slice of a merged layer in one launch.

Tokens arrive grouped by adapter slot (punica's "v1" layout, as vLLM's lora_shrink/lora_expand): the token indices
sorted by slot, and per group its slot, first index and length, in persistent buffers. The grid is sized by the
token count and the group capacity (max_loras), never by the live grouping, so a CUDA graph captured once replays
any mix of adapters; programs of unused groups or past their group's tokens return at once. The launch policy
picks the tile: a decode-sized batch (BGMV: few tokens per adapter) takes 16-row tiles, a prefill (SGMV: segments
of many tokens) 64-row tiles. A decode-sized shrink also splits the reduction over `in` (split-K): one token's
A is 100s of KB, which one program per adapter would read alone, so up to 32 programs each write a partial sum
(s is [T, SPLIT_K, n]) and the expand adds the partials as it loads them: no atomics, no zeroing, deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

DECODE_MAX_TOKENS = 64  # up to this many tokens a step is decode-like: 16-row tiles


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
