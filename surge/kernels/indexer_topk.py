"""The lightning indexer's top-k in Triton: per query row, the `index_topk` best-scored compressed entries, exact
against deepseek_v4_reference.indexer_topk (a CPU stable sort in the same total order).

Ordering is total: scores map to int32 keys (NaN above +inf, -0.0 equal to +0.0) and ties go to the lower index;
indices come out in ascending order, -1 past a row's min(k, length). The k-th largest key is found by a radix search
(RADIX_BITS bits of the threshold per pass, each pass counting the row against 2**RADIX_BITS candidates), then the
keys above it and the first tied ones are compacted by a prefix sum. Short rows: one program per row, the row in
registers. Long rows: programs per chunk of the row write each chunk's top-k (key, index) into scratch, and a
second kernel selects from their union: the global top-k of a strict total order is within its chunks' top-k, and
the union lies in ascending index order, so ties resolve alike. Geometry is a pure function of the capacity (the
score buffer's width), never of live lengths; nothing is counted across programs (no atomics) and every scratch
slot is rewritten by each launch before it is read, so CUDA graph replays carry nothing over and need no zeroing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.warmup import CompiledKernel

SHORT_MAX = 4096  # rows up to this capacity: one program per row
CHUNK = 4096  # split rows: entries per chunk program (grown until the merge fits)
MAX_CHUNK = 16384
MERGE_MAX = 8192  # the merge holds num_chunks * k candidates in registers
RADIX_BITS = 2

_KEY_MIN = tl.constexpr(-2147483648)  # below every key (key(-inf) = -2139095041): entries past the length
_KEY_NAN = tl.constexpr(2147483647)


@dataclass(frozen=True)
class TopKLaunch:
    block: int  # entries per program: the whole row (short), or one chunk (split)
    num_chunks: int  # 1: short rows, no merge
    merge_block: int  # split: the merge's tile, num_chunks * k padded (0 when short)
    radix_bits: int
    num_warps: int
    merge_num_warps: int = 4

    @property
    def split(self) -> bool:
        return self.num_chunks > 1


def _warps(block: int) -> int:
    return min(16, max(4, block // 512))


def launch_policy(max_len: int, k: int, radix_bits: int = RADIX_BITS) -> TopKLaunch:
    """Pure function of capacities: max_len, the width of the score buffer (a CUDA graph's capacity); k, the
    index_topk. Live row lengths never enter it."""
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    if max_len < 1:
        raise ValueError(f"max_len={max_len} must be >= 1")
    if radix_bits not in (1, 2, 4, 8):
        raise ValueError(f"radix_bits={radix_bits} must divide 32 and be at most 8 (1, 2, 4 or 8)")
    if max_len <= SHORT_MAX:
        block = triton.next_power_of_2(max_len)
        return TopKLaunch(block, 1, 0, radix_bits, _warps(block))
    chunk = CHUNK
    while triton.next_power_of_2(triton.cdiv(max_len, chunk) * k) > MERGE_MAX and chunk < MAX_CHUNK:
        chunk *= 2
    merge = triton.next_power_of_2(triton.cdiv(max_len, chunk) * k)
    if merge > MERGE_MAX:
        raise ValueError(f"max_len={max_len} with k={k} is beyond the split top-k: at most "
                         f"{MERGE_MAX // k * MAX_CHUNK} entries a row for this k")
    return split_launch(max_len, k, chunk, radix_bits)


def split_launch(max_len: int, k: int, chunk: int, radix_bits: int = RADIX_BITS) -> TopKLaunch:
    """The split geometry for a chunk size (tests use small chunks to reach the merge on small rows)."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk} must be a power of two")
    num_chunks = triton.cdiv(max_len, chunk)
    merge = triton.next_power_of_2(num_chunks * k)
    return TopKLaunch(chunk, num_chunks, merge, radix_bits, _warps(chunk), _warps(merge))


@triton.jit
def _order_key(x):
    """int32 keys ordering float32 totally: NaN highest, then +inf ... -inf; -0 and +0 equal (as sampling's)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    return tl.where(x != x, _KEY_NAN, key)


@triton.jit
def _select(key, need, RADIX_BITS: tl.constexpr):
    """(selected, slot): the `need` largest keys, ties to the lower position, and each one's rank by position.
    Keys of absent entries are _KEY_MIN and need <= the number present, so they are never chosen."""
    # The threshold as an offset u in [0, 2**32) above _KEY_MIN, built RADIX_BITS bits at a time from the top: the
    # largest u with count(key >= _KEY_MIN + u) >= need. Candidates are compared as int32 (_KEY_MIN + u fits).
    digits = tl.arange(0, 1 << RADIX_BITS).to(tl.int64)
    prefix = need.to(tl.int64) * 0
    # The digit's shift is written out at each use: the compiler unrolls static_range by visiting the body once per
    # step, and an annotated constexpr (`shift: tl.constexpr = ...`) would be "reassigned" at the second visit (a
    # CompilationError the interpreter never raises), while a plain `shift = ...` would turn it into a tensor.
    for step in tl.static_range(32 // RADIX_BITS):
        candidate = (prefix + (digits << (32 - RADIX_BITS * (step + 1))) + _KEY_MIN).to(tl.int32)
        counts = tl.sum((key[None, :] >= candidate[:, None]).to(tl.int32), axis=1)
        digit = tl.sum((counts >= need).to(tl.int64), axis=0) - 1  # counts fall with the digit; digit 0 always holds
        prefix += digit << (32 - RADIX_BITS * (step + 1))
    threshold = (prefix + _KEY_MIN).to(tl.int32)
    above = key > threshold
    tied = key == threshold
    ties_wanted = need - tl.sum(above.to(tl.int32), axis=0)
    tie_rank = tl.cumsum(tied.to(tl.int32), axis=0) - tied.to(tl.int32)
    selected = above | (tied & (tie_rank < ties_wanted))
    slot = tl.cumsum(selected.to(tl.int32), axis=0) - selected.to(tl.int32)
    return selected, slot


@triton.jit
def _chunk_topk_kernel(scores_ptr, lengths_ptr, out_idx_ptr, out_key_ptr, stride_s, stride_o, K: tl.constexpr,
                       K_PAD: tl.constexpr, MAX_LEN: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                       RADIX_BITS: tl.constexpr, WRITE_KEYS: tl.constexpr):
    # Program (row, chunk): the chunk's top-k into out[row, chunk * K : (chunk + 1) * K], every slot written (-1
    # past the chosen), keys too when WRITE_KEYS (the split's scratch). Short rows: one chunk, out is the result.
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    length = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), MAX_LEN)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    present = offs < length
    key = tl.where(present, _order_key(tl.load(scores_ptr + row * stride_s + offs, mask=present, other=0.0)
                                       .to(tl.float32)), _KEY_MIN)
    need = tl.minimum(tl.sum(present.to(tl.int32), axis=0), K)
    selected, slot = _select(key, need, RADIX_BITS)
    base = row * stride_o + chunk * K
    tl.store(out_idx_ptr + base + slot, offs, mask=selected)
    rest = tl.arange(0, K_PAD)
    empty = (rest >= need) & (rest < K)
    tl.store(out_idx_ptr + base + rest, tl.full((K_PAD,), -1, tl.int32), mask=empty)
    if WRITE_KEYS:
        tl.store(out_key_ptr + base + slot, key, mask=selected)
        tl.store(out_key_ptr + base + rest, tl.full((K_PAD,), _KEY_MIN, tl.int32), mask=empty)


@triton.jit
def _merge_topk_kernel(cand_idx_ptr, cand_key_ptr, lengths_ptr, out_ptr, stride_c, stride_o, K: tl.constexpr,
                       K_PAD: tl.constexpr, MAX_LEN: tl.constexpr, NUM_CANDIDATES: tl.constexpr,
                       BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):
    # One program per row: the top-k of its chunks' candidates (in ascending index order, absent ones keyed
    # _KEY_MIN), written in ascending index order.
    row = tl.program_id(0).to(tl.int64)
    length = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), MAX_LEN)
    offs = tl.arange(0, BLOCK)
    in_range = offs < NUM_CANDIDATES
    key = tl.load(cand_key_ptr + row * stride_c + offs, mask=in_range, other=_KEY_MIN)
    idx = tl.load(cand_idx_ptr + row * stride_c + offs, mask=in_range, other=-1)
    need = tl.minimum(length, K)
    selected, slot = _select(key, need, RADIX_BITS)
    tl.store(out_ptr + row * stride_o + slot, idx, mask=selected)
    rest = tl.arange(0, K_PAD)
    tl.store(out_ptr + row * stride_o + rest, tl.full((K_PAD,), -1, tl.int32), mask=(rest >= need) & (rest < K))


@dataclass(frozen=True)
class TopKKey:
    dtype: torch.dtype  # of the scores
    max_len: int
    k: int
    launch: TopKLaunch


def workspace_shape(rows: int, key: TopKKey) -> tuple[int, ...]:
    """The split's scratch: candidate indices and keys, num_chunks * k int32 of each per row ((0,) when short)."""
    return (2, rows, key.launch.num_chunks * key.k) if key.launch.split else (0,)


class IndexerTopK(CompiledKernel):
    """Per row, the k best-scored entries among the row's first `lengths[row]`: [rows, k] int32 indices."""
    parallel_compile = True

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def dispatch(self, *, max_len: int, k: int, dtype: torch.dtype = torch.float32) -> TopKKey:
        return TopKKey(dtype, max_len, k, launch_policy(max_len, k))

    def __call__(self, scores: torch.Tensor, lengths: torch.Tensor, k: int, *, out: torch.Tensor | None = None,
                 workspace: torch.Tensor | None = None, launch: TopKLaunch | None = None) -> torch.Tensor:
        """scores [rows, max_len] float (unit stride on entries; its width is the capacity the launch is chosen
        for); lengths [rows] int32, clamped to [0, max_len] in the kernel (no host sync). Entries at and past a
        row's length are never read. `workspace` (split launches): int32 of `workspace_shape`, allocated when
        None. `launch` overrides the policy (tests)."""
        if scores.dim() != 2 or scores.stride(1) != 1:
            raise ValueError(f"scores must be [rows, max_len] with unit stride on entries, got "
                             f"{tuple(scores.shape)} strides {scores.stride()}")
        if lengths.shape != (scores.shape[0],) or lengths.dtype != torch.int32:
            raise ValueError(f"lengths must be int32 [{scores.shape[0]}], got {lengths.dtype} {tuple(lengths.shape)}")
        key = self.dispatch(max_len=scores.shape[1], k=k, dtype=scores.dtype)
        if launch is not None:
            key = TopKKey(scores.dtype, scores.shape[1], k, launch)
        self.ensure(key)
        rows = scores.shape[0]
        if out is None:
            out = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
        if out.shape != (rows, k) or out.dtype != torch.int32 or out.stride(1) != 1:
            raise ValueError(f"out must be int32 [{rows}, {k}] with unit stride, got {out.dtype} {tuple(out.shape)}")
        if workspace is None:
            workspace = torch.empty(workspace_shape(rows, key), dtype=torch.int32, device=scores.device)
        elif workspace.shape != workspace_shape(rows, key) or workspace.dtype != torch.int32:
            raise ValueError(f"workspace must be int32 {workspace_shape(rows, key)}, got {workspace.dtype} "
                             f"{tuple(workspace.shape)}")
        if rows:
            _launch(key, scores, lengths, out, workspace, warmup=False)
        return out

    def compile(self, key: TopKKey) -> object:
        dev = self.device
        scores = torch.empty(1, key.max_len, dtype=key.dtype, device=dev)
        workspace = torch.empty(workspace_shape(1, key), dtype=torch.int32, device=dev)
        return _launch(key, scores, torch.ones(1, dtype=torch.int32, device=dev),
                       torch.empty(1, key.k, dtype=torch.int32, device=dev), workspace, warmup=True)


def _launch(key: TopKKey, scores, lengths, out, workspace, warmup: bool):
    launch, rows, k = key.launch, scores.shape[0], key.k
    common = dict(K=k, K_PAD=triton.next_power_of_2(k), MAX_LEN=key.max_len, RADIX_BITS=launch.radix_bits)
    chunk_constexprs = dict(BLOCK=launch.block, NUM_CHUNKS=launch.num_chunks, WRITE_KEYS=launch.split,
                            num_warps=launch.num_warps, **common)
    if not launch.split:
        args = (scores, lengths, out, out, scores.stride(0), out.stride(0))
        if warmup:
            return _chunk_topk_kernel.warmup(*args, grid=(rows, 1), **chunk_constexprs)
        _chunk_topk_kernel[(rows, 1)](*args, **chunk_constexprs)
        return out
    cand_idx, cand_key = workspace[0], workspace[1]
    chunk_args = (scores, lengths, cand_idx, cand_key, scores.stride(0), cand_idx.stride(0))
    merge_args = (cand_idx, cand_key, lengths, out, cand_idx.stride(0), out.stride(0))
    merge_constexprs = dict(NUM_CANDIDATES=launch.num_chunks * k, BLOCK=launch.merge_block,
                            num_warps=launch.merge_num_warps, **common)
    if warmup:
        return (_chunk_topk_kernel.warmup(*chunk_args, grid=(rows, launch.num_chunks), **chunk_constexprs),
                _merge_topk_kernel.warmup(*merge_args, grid=(rows,), **merge_constexprs))
    _chunk_topk_kernel[(rows, launch.num_chunks)](*chunk_args, **chunk_constexprs)
    _merge_topk_kernel[(rows,)](*merge_args, **merge_constexprs)
    return out
