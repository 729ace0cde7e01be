"""Multi-LoRA in Triton: y[:, slice j] += (x @ A[slot, slice j]^T) @ B[slot, slice j]^T for every token of an
adapter, every slice of a merged layer (q/k/v, gate/up) in the same launch; `lora_add` runs it, `lora_policy` says how.

Tokens arrive grouped by adapter slot (punica's "v1" layout): the token indices sorted by slot, and per group its slot,
first index and length, in persistent buffers. A program's tile of rows is found in the kernel: the groups' tiles
are numbered one group after another (a cumulative sum over max_loras lengths), so every tile is one adapter and
the grid is cdiv(T, BLOCK_M) + min(max_loras, T) - 1 tiles, an upper bound set by the token count alone: a CUDA
graph captured once replays any mix of adapters, and no program is spent on groups that are empty this step.

Two paths, chosen by `lora_policy` from the token count and the shapes only:
- split (shrink, then expand): the shrink writes s = x @ A^T as float32 partial sums over split-K chunks of `in`
  ([T, split_k, slices * r]; no atomics, deterministic), the expand adds the partials as it loads them.
- fused (a few tokens, A of one slice small): one kernel; each program recomputes its rows' s for its slice (A's
  r x in from L2) and expands its columns. One launch and one dependent load chain instead of two.
The expand's programs each cover a run of column tiles of one slice (s loaded once, B and y streamed), the column
tiles numbered slice after slice, so no program is spent past a short slice either. Numerics by tile: 16-row tiles
multiply s and B in float32, 64-row tiles (prefill) round s to the adapter's dtype for tensor cores, as PEFT does.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

DECODE_MAX_TOKENS = 64  # up to this many tokens a step is decode-like: 16-row tiles, float32 FMA
# Fused shrink+expand up to FUSED_MAX_TOKENS tokens, where every program's re-read of its slice's A (padded rank x
# in, from L2) stays short: at most FUSED_MAX_A_BYTES a program and FUSED_MAX_REREAD_BYTES over the grid (Qwen3-8B,
# rank 16, bf16: one token fused in all four groups, 128 KB a program (down: 384 KB) and 4-12 MB in all; 16 tokens
# of 8 adapters fused for q/k/v, o and gate/up). FUSED_MAX_TOKENS = 0 turns the fused path off.
FUSED_MAX_TOKENS = 16
FUSED_MAX_A_BYTES = 512 * 1024
FUSED_MAX_REREAD_BYTES = 20 * 1024 * 1024
TILE_BYTES = 16 * 1024  # a loaded tile of A, B, x or y at most: 3 pipeline stages stay within shared memory
FUSED_PROGRAMS = 128  # about one program per SM (H200: 132)
EXPAND_PROGRAMS = 1024  # enough column runs per program to amortize its s load, enough programs to fill the SMs
SPLIT_K_CHUNK = 256  # a decode-sized shrink's `in` columns per program
MAX_SPLIT_K = 32  # the expand adds up to this many partials per tile it loads
PREFILL_MAX_SPLIT_K = 4  # a prefill's partials are [64 rows, split, n]: few, so the expand's s loads stay small
WARM_UP_TOKEN_COUNTS = (1, FUSED_MAX_TOKENS + 1, DECODE_MAX_TOKENS + 1)  # one step size per path and tile shape


@dataclass(frozen=True)
class LoRALaunch:
    fused: bool  # one kernel, each program recomputing its rows' shrink
    block_m: int  # token rows per tile (one adapter)
    block_r: int  # the rank padded to a power of two >= 16
    block_n: int  # expand: output columns per step
    tiles_per_program: int  # expand: column tiles (of one slice) per program
    shrink_block_n: int  # split shrink: s columns per program
    block_k: int  # shrink (split or fused): `in` columns per step
    split_k: int  # split shrink: partial sums over `in`
    num_warps: int
    num_stages: int  # fused: one more than Triton's 3 in flight, since one program streams all of A's slice alone


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


@lru_cache(maxsize=1024)  # an eager step asks once per layer: the answer is the same for every layer of a shape
def lora_policy(num_tokens: int, max_groups: int, in_features: int, slice_sizes: tuple[int, ...], rank: int,
                itemsize: int, fused: bool | None = None) -> LoRALaunch:
    """The launch for num_tokens rows of x [T, in_features] (itemsize bytes an element), adapters of (max) rank
    `rank` in up to max_groups slots, output slices of slice_sizes columns. fused: the path (None: the policy's;
    the benchmark and the tests ask for the other one too)."""
    block_r = max(16, _pow2(rank))
    groups = max(1, min(max_groups, num_tokens))
    decode = num_tokens <= DECODE_MAX_TOKENS
    block_m = 16 if decode else 64
    m_tiles = triton.cdiv(num_tokens, block_m) + groups - 1
    block_n = max(16, min(128, _pow2(max(slice_sizes)), TILE_BYTES // (max(block_r, block_m) * itemsize)))
    col_tiles = sum(triton.cdiv(size, block_n) for size in slice_sizes)

    def runs(target: int) -> tuple[int, int]:
        """(column tiles a program, programs) for about `target` programs."""
        per_program = max(1, triton.cdiv(m_tiles * col_tiles, target))
        return per_program, m_tiles * sum(triton.cdiv(triton.cdiv(size, block_n), per_program) for size in slice_sizes)

    if fused is None:
        a_bytes = block_r * in_features * itemsize
        fused = (num_tokens <= FUSED_MAX_TOKENS and a_bytes <= FUSED_MAX_A_BYTES
                 and runs(FUSED_PROGRAMS)[1] * a_bytes <= FUSED_MAX_REREAD_BYTES)
    tiles_per_program = runs(FUSED_PROGRAMS if fused else EXPAND_PROGRAMS)[0]
    n = len(slice_sizes) * rank
    shrink_block_n = max(16, min(64, _pow2(n)))
    if fused:  # long `in` steps (few dependent loads), within TILE_BYTES a tile
        block_k = max(16, min(TILE_BYTES // (block_r * itemsize), TILE_BYTES // (block_m * itemsize),
                              _pow2(in_features)))
    else:
        block_k = max(16, min(128 if decode or itemsize <= 2 else 64, _pow2(in_features)))
    if fused:
        split_k = 1
    elif decode:  # one token's A is 100s of KB: up to 32 programs share it
        split_k = min(MAX_SPLIT_K, triton.cdiv(in_features, SPLIT_K_CHUNK))
    else:  # a prefill's long `in` loop is latency-bound when there are fewer programs than SMs (2048 tokens: 32
        # tiles of 64 rows). By the shape alone, so every step size runs the kernels the warm-up compiled.
        split_k = max(1, min(PREFILL_MAX_SPLIT_K, triton.cdiv(in_features, 4 * block_k)))
    num_warps = 4 if decode else 8  # a prefill's 64 x 128 float32 tile: 64 registers a thread at 8 warps
    return LoRALaunch(fused, block_m, block_r, block_n, tiles_per_program, shrink_block_n, block_k, split_k,
                      num_warps, 4 if fused else 3)


@triton.jit
def _tile_rows(sorted_ptr, slot_ptr, start_ptr, len_ptr, num_groups, tile, BLOCK_M: tl.constexpr,
               GROUPS: tl.constexpr):
    """The slot of the tile-th tile of BLOCK_M token rows (the groups' tiles numbered one group after another), its
    rows and their mask; slot -1: past the last tile."""
    g = tl.arange(0, GROUPS)
    live = g < num_groups
    slots = tl.load(slot_ptr + g, mask=live, other=-1)
    starts = tl.load(start_ptr + g, mask=live, other=0)
    lens = tl.load(len_ptr + g, mask=live, other=0)
    tiles = (lens + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    group = tl.sum((ends <= tile).to(tl.int32), 0)  # empty groups (no tiles) are stepped over
    here = g == group
    slot = tl.where(group < num_groups, tl.sum(tl.where(here, slots, 0), 0), -1)
    count = tl.sum(tl.where(here, lens, 0), 0)
    offs = (tile - tl.sum(tl.where(here, ends - tiles, 0), 0)) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    rows = tl.load(sorted_ptr + tl.sum(tl.where(here, starts, 0), 0) + offs, mask=mask, other=0).to(tl.int64)
    return slot, rows, mask


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, s_ptr, sorted_ptr, slot_ptr, start_ptr, len_ptr, num_groups, n, k, k_per_split,
                   stride_x, stride_as, stride_an, stride_s, stride_split, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
    slot, rows, mask_m = _tile_rows(sorted_ptr, slot_ptr, start_ptr, len_ptr, num_groups, tl.program_id(0), BLOCK_M,
                                    GROUPS)
    if slot < 0:
        return
    split = tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, k), BLOCK_K):  # may be empty: zeros stored
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k
        xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)
        at = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None], mask=mask_n[None, :] & mask_k[:, None],
                     other=0.0)
        acc += tl.dot(xt, at, input_precision="ieee")
    tl.store(s_ptr + rows[:, None] * stride_s + split * stride_split + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["tiles_per_program"])  # set by the step's size: one compiled kernel for all
def _expand_kernel(x_ptr, a_ptr, s_ptr, b_ptr, y_ptr, offsets_ptr, sorted_ptr, slot_ptr, start_ptr, len_ptr,
                   num_groups, num_slices, k, rank, tiles_per_program, stride_x, stride_as, stride_an, stride_s,
                   stride_split, stride_bs, stride_bn, stride_y, FUSED: tl.constexpr, SPLIT_K: tl.constexpr,
                   TENSOR_CORES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUPS: tl.constexpr, SLICES: tl.constexpr, OFFSET_ALIGN: tl.constexpr):
    slot, rows, mask_m = _tile_rows(sorted_ptr, slot_ptr, start_ptr, len_ptr, num_groups, tl.program_id(0), BLOCK_M,
                                    GROUPS)
    if slot < 0:
        return
    # This program's slice j and run of column tiles: each slice's runs numbered one slice after another.
    sl = tl.arange(0, SLICES)
    firsts = tl.load(offsets_ptr + sl, mask=sl < num_slices, other=0)
    sizes = tl.load(offsets_ptr + sl + 1, mask=sl < num_slices, other=0) - firsts
    runs = ((sizes + BLOCK_N - 1) // BLOCK_N + tiles_per_program - 1) // tiles_per_program
    ends = tl.cumsum(runs, 0)
    pid_n = tl.program_id(1)
    j = tl.sum((ends <= pid_n).to(tl.int32), 0)
    here = sl == j
    # Slices of real models start and end at multiples of 8 columns: said (as // and *, which the compiler's
    # alignment analysis follows; tl.multiple_of on a reduction's result was lost), so y's rows load and store as
    # 16-byte vectors, the column mask holding for 8 columns at a time.
    first = tl.sum(tl.where(here, firsts, 0), 0) // OFFSET_ALIGN * OFFSET_ALIGN
    size = tl.sum(tl.where(here, sizes, 0), 0) // OFFSET_ALIGN * OFFSET_ALIGN
    run = pid_n - tl.sum(tl.where(here, ends - runs, 0), 0)

    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + first * stride_bn
    y_base = y_ptr + rows[:, None] * stride_y + first
    first_tile = run * tiles_per_program
    # The first column tile's B and y are loaded first: in flight while s is computed or loaded.
    bt, y, y_ptrs, mask = _load_tile(b_base, y_base, first_tile, size, mask_m, offs_r, mask_r, stride_bn, BLOCK_N)
    if FUSED:  # s = x[rows] @ A[slot, slice j]^T, the whole of `in` in this program
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + (j * rank + offs_r) * stride_an
        st = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k
            # A first: its address needs only the slot, x's the rows (one more load): warps issue in order
            at = tl.load(a_rows[None, :] + offs_k[:, None], mask=mask_r[None, :] & mask_k[:, None], other=0.0)
            xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                         other=0.0)
            st += tl.dot(xt, at, input_precision="ieee")
    else:  # the shrink's partial sums
        s_tile = s_ptr + rows[:, None] * stride_s + j * rank + offs_r[None, :]
        mask_s = mask_m[:, None] & mask_r[None, :]
        st = tl.load(s_tile, mask=mask_s, other=0.0)
        for split in tl.static_range(1, SPLIT_K):
            st += tl.load(s_tile + split * stride_split, mask=mask_s, other=0.0)
    if TENSOR_CORES:  # prefill tiles: s rounded to the adapter's dtype, as PEFT's lora_B(lora_A(x)) computes in it
        st = st.to(b_ptr.dtype.element_ty)
    _add_tile(st, bt, y, y_ptrs, mask, TENSOR_CORES)
    for t in range(first_tile + 1, tl.minimum((run + 1) * tiles_per_program, (size + BLOCK_N - 1) // BLOCK_N)):
        bt, y, y_ptrs, mask = _load_tile(b_base, y_base, t, size, mask_m, offs_r, mask_r, stride_bn, BLOCK_N)
        _add_tile(st, bt, y, y_ptrs, mask, TENSOR_CORES)


@triton.jit
def _load_tile(b_base, y_base, t, size, mask_m, offs_r, mask_r, stride_bn, BLOCK_N: tl.constexpr):
    """Column tile t of the slice: B's [rank, BLOCK_N] tile (transposed), y's rows there, their pointers and mask."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < size
    mask = mask_m[:, None] & mask_n[None, :]
    bt = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None], mask=mask_n[None, :] & mask_r[:, None],
                 other=0.0)
    y_ptrs = y_base + offs_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    return bt, y, y_ptrs, mask


@triton.jit
def _add_tile(st, bt, y, y_ptrs, mask, TENSOR_CORES: tl.constexpr):
    """y += s @ B^T on one tile: tensor cores for prefill tiles, float32 FMA else (few rows; float32 adapters exact)."""
    if TENSOR_CORES:
        delta = tl.dot(st, bt)
    else:
        delta = tl.dot(st, bt.to(tl.float32), input_precision="ieee")
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, slice_offsets: torch.Tensor,
             slices: tuple[tuple[int, int], ...], sorted_tokens: torch.Tensor, slot_ids: torch.Tensor,
             group_start: torch.Tensor, group_len: torch.Tensor, launch: LoRALaunch | None = None) -> None:
    """y[t, o_j:o_j + size_j] += (x[t] @ a[slot, j*r:(j+1)*r]^T) @ b[slot, o_j:o_j + size_j]^T for every grouped
    token t (its group's slot) and slice j: x [T, in], a [L, slices * r, in], b [L, out, r], y [T, out] (rows
    may be strided); slice_offsets: [slices + 1] int32 output offsets o_j on the device, slices: (o_j, size_j) on
    the host.
    Tokens in no group are left as they are. launch: the policy's unless given (benchmarks, tests)."""
    num_tokens, k = x.shape
    slice_sizes = tuple(size for _, size in slices)
    rank = b.shape[2]
    num_groups = slot_ids.shape[0]
    if num_tokens == 0:
        return
    p = launch or lora_policy(num_tokens, num_groups, k, slice_sizes, rank, x.element_size())
    groups_p2 = max(2, _pow2(num_groups))
    m_tiles = triton.cdiv(num_tokens, p.block_m) + min(num_groups, num_tokens) - 1
    if p.fused:
        s, split_k = x, 1  # s unused
    else:
        n = a.shape[1]
        s = torch.empty(num_tokens, p.split_k, n, dtype=torch.float32, device=x.device)
        k_per_split = triton.cdiv(triton.cdiv(k, p.split_k), p.block_k) * p.block_k
        _shrink_kernel[(m_tiles, triton.cdiv(n, p.shrink_block_n), p.split_k)](
            x, a, s, sorted_tokens, slot_ids, group_start, group_len, num_groups, n, k, k_per_split, x.stride(0),
            a.stride(0), a.stride(1), s.stride(0), s.stride(1), BLOCK_M=p.block_m, BLOCK_N=p.shrink_block_n,
            BLOCK_K=p.block_k, GROUPS=groups_p2, num_warps=p.num_warps)
        split_k = p.split_k
    runs = sum(triton.cdiv(triton.cdiv(size, p.block_n), p.tiles_per_program) for size in slice_sizes)
    tensor_cores = b.dtype != torch.float32 and p.block_m >= 64
    _expand_kernel[(m_tiles, runs)](
        x, a, s, b, y, slice_offsets, sorted_tokens, slot_ids, group_start, group_len, num_groups, len(slice_sizes),
        k, rank, p.tiles_per_program, x.stride(0), a.stride(0), a.stride(1), s.stride(0), s.stride(1), b.stride(0),
        b.stride(1), y.stride(0), FUSED=p.fused, SPLIT_K=split_k, TENSOR_CORES=tensor_cores, BLOCK_M=p.block_m,
        BLOCK_N=p.block_n, BLOCK_R=p.block_r, BLOCK_K=p.block_k, GROUPS=groups_p2,
        SLICES=max(2, _pow2(len(slice_sizes))),
        OFFSET_ALIGN=8 if all(o % 8 == 0 and size % 8 == 0 for o, size in slices) else 1, num_warps=p.num_warps,
        num_stages=p.num_stages)
