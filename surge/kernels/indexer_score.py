"""The lightning indexer's scores in Triton: for each query row t and compressed entry s < lengths[t],
sum_h relu(q[t, h] . key[s]) * softmax_scale * weights[t, h] * weights_scale (HF's DeepseekV4IndexerScorer),
with the keys read from the indexer's paged key cache. The scores are what indexer_topk.IndexerTopK consumes.

One program per (row, tile of BLOCK_N entries): all heads of the row against the tile in one tl.dot, relu and the
head weights applied to the [heads, entries] product, summed over heads. The grid spans the capacity (max_len); tiles
past a row's length load and store nothing, and entries at or past it are left unwritten (the top-k never reads them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.warmup import CompiledKernel

MAX_HEADS = 128
MAX_HEAD_DIM = 512


@dataclass(frozen=True)
class ScoreLaunch:
    heads_pad: int
    head_dim_pad: int
    block_n: int  # compressed entries per program
    num_warps: int


def launch_policy(num_heads: int, head_dim: int) -> ScoreLaunch:
    """Pure function of the indexer's shape (index_n_heads, index_head_dim): tiles of 64 entries once the query
    tile reaches 8192 elements (the [heads, entries] product then stays at 64 fp32 registers a thread with 8
    warps), else 128; tl.dot needs every dimension >= 16."""
    if not 1 <= num_heads <= MAX_HEADS:
        raise ValueError(f"num_heads={num_heads} must be in [1, {MAX_HEADS}]")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} must be in [1, {MAX_HEAD_DIM}]")
    heads_pad = max(16, triton.next_power_of_2(num_heads))
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if heads_pad * dim_pad >= 8192 else 128
    return ScoreLaunch(heads_pad, dim_pad, block_n, num_warps=8 if heads_pad * block_n >= 4096 else 4)


@triton.jit
def _score_kernel(q_ptr, w_ptr, cache_ptr, table_ptr, row_seq_ptr, lengths_ptr, out_ptr, stride_qt, stride_qh,
                  stride_wt, stride_cb, stride_cs, stride_bt, stride_o, softmax_scale, weights_scale,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr, CACHE_BLOCK: tl.constexpr, MAX_LEN: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_ROW_SEQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    length = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), MAX_LEN)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    present = offs < length
    seq = tl.load(row_seq_ptr + row).to(tl.int64) if HAS_ROW_SEQ else row
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_ok = heads < NUM_HEADS
    dim_ok = dims < HEAD_DIM
    any_present = tl.program_id(1) * BLOCK_N < length  # tiles past the length load nothing
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=(head_ok[:, None] & dim_ok[None, :]) & any_present, other=0.0)
    block = tl.load(table_ptr + seq * stride_bt + offs // CACHE_BLOCK, mask=present, other=0).to(tl.int64)
    keys = tl.load(cache_ptr + block[:, None] * stride_cb + (offs % CACHE_BLOCK)[:, None] * stride_cs
                   + dims[None, :], mask=present[:, None] & dim_ok[None, :], other=0.0)
    logits = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION)  # [heads, entries], fp32
    w = tl.load(w_ptr + row * stride_wt + heads, mask=head_ok & any_present, other=0.0).to(tl.float32)
    scores = tl.maximum(logits, 0.0) * softmax_scale * (w * weights_scale)[:, None]
    tl.store(out_ptr + row * stride_o + offs, tl.sum(scores, axis=0), mask=present)


@dataclass(frozen=True)
class ScoreKey:
    dtype: torch.dtype  # of q and the key cache
    num_heads: int
    head_dim: int
    cache_block: int
    max_len: int
    row_seq: bool  # rows map to block-table rows through row_seq (prefill), or one to one (decode)
    launch: ScoreLaunch


class IndexerScores(CompiledKernel):
    """scores[t, s] for s < lengths[t]: see the module docstring."""
    parallel_compile = True

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def dispatch(self, *, num_heads: int, head_dim: int, cache_block: int, max_len: int, dtype: torch.dtype,
                 row_seq: bool = False) -> ScoreKey:
        return ScoreKey(dtype, num_heads, head_dim, cache_block, max_len, row_seq, launch_policy(num_heads, head_dim))

    def __call__(self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
                 lengths: torch.Tensor, *, max_len: int, softmax_scale: float, weights_scale: float,
                 row_seq: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D] (unit stride on D); weights [T, H] (weights_proj's output, any float dtype); key_cache
        [num_blocks, block_size, D] of q's dtype; block_table [seqs, max_blocks] int32; lengths [T] int32 (entries
        row t may see, clamped to [0, max_len]); row_seq [T] int32: the block-table row of each query row (None:
        row t reads block_table[t]). Returns out [T, max_len] float32 (allocated when None)."""
        rows, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or key_cache.stride(2) != 1:
            raise ValueError("q and key_cache must have unit stride on head_dim")
        if key_cache.dim() != 3 or key_cache.shape[2] != head_dim or key_cache.dtype != q.dtype:
            raise ValueError(f"key_cache must be [num_blocks, block_size, {head_dim}] of {q.dtype}, got "
                             f"{key_cache.dtype} {tuple(key_cache.shape)}")
        if weights.shape != (rows, num_heads) or weights.stride(1) != 1:
            raise ValueError(f"weights must be [{rows}, {num_heads}] with unit stride on heads, got "
                             f"{tuple(weights.shape)} strides {weights.stride()}")
        for name, t in (("lengths", lengths), ("block_table", block_table), ("row_seq", row_seq)):
            if t is not None and t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
        key = self.dispatch(num_heads=num_heads, head_dim=head_dim, cache_block=key_cache.shape[1],
                            max_len=max_len, dtype=q.dtype, row_seq=row_seq is not None)
        self.ensure(key)
        if out is None:
            out = torch.empty(rows, max_len, dtype=torch.float32, device=q.device)
        if out.shape != (rows, max_len) or out.dtype != torch.float32 or out.stride(1) != 1:
            raise ValueError(f"out must be float32 [{rows}, {max_len}], got {out.dtype} {tuple(out.shape)}")
        if rows:
            _launch(key, q, weights, key_cache, block_table, row_seq, lengths, out, softmax_scale, weights_scale,
                    warmup=False)
        return out

    def compile(self, key: ScoreKey) -> object:
        dev, h, d = self.device, key.num_heads, key.head_dim
        i32 = dict(dtype=torch.int32, device=dev)
        return _launch(key, torch.empty(1, h, d, dtype=key.dtype, device=dev), torch.empty(1, h, device=dev),
                       torch.empty(1, key.cache_block, d, dtype=key.dtype, device=dev), torch.zeros(1, 1, **i32),
                       torch.zeros(1, **i32) if key.row_seq else None, torch.ones(1, **i32),
                       torch.empty(1, key.max_len, device=dev), 1.0, 1.0, warmup=True)


def _launch(key: ScoreKey, q, weights, key_cache, block_table, row_seq, lengths, out, softmax_scale, weights_scale,
            warmup: bool):
    launch = key.launch
    grid = (q.shape[0], triton.cdiv(key.max_len, launch.block_n))
    args = (q, weights, key_cache, block_table, row_seq if row_seq is not None else lengths, lengths, out,
            q.stride(0), q.stride(1), weights.stride(0), key_cache.stride(0), key_cache.stride(1),
            block_table.stride(0), out.stride(0), softmax_scale, weights_scale)
    constexprs = dict(NUM_HEADS=key.num_heads, HEAD_DIM=key.head_dim, HEADS_PAD=launch.heads_pad,
                      HEAD_DIM_PAD=launch.head_dim_pad, CACHE_BLOCK=key.cache_block, MAX_LEN=key.max_len,
                      BLOCK_N=launch.block_n, HAS_ROW_SEQ=key.row_seq,
                      DOT_PRECISION="ieee" if key.dtype == torch.float32 else "tf32", num_warps=launch.num_warps)
    if warmup:
        return _score_kernel.warmup(*args, grid=grid, **constexprs)
    _score_kernel[grid](*args, **constexprs)
    return out
