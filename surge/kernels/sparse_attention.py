"""DeepSeek V4's attention in Triton: each query token over its sliding window of token rows plus compressed entries
(CSA: the indexer's top-k; HCA: every complete one), one shared key-value head (K = V), a learned sink per head in
the softmax's denominator. The definition is deepseek_v4_reference.sparse_attention.

One program per (token, tile of BLOCK_H heads): all the tile's heads against BLOCK_N keys at a time in one tl.dot,
an online softmax whose running maximum starts at the head's sink logit (with its exp, 1, as the running sum), so
the sink joins the denominator and adds no value. A token finds its request and position in device tensors and its
keys through the block tables, so a launch is independent of live lengths: a captured CUDA graph replays for any.
The window's tiles are a static count; HCA loops over its complete entries ((position + 1) // rate, read on the
device); CSA over the top-k list (-1 skips).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.warmup import CompiledKernel

MAX_HEAD_DIM = 1024
SLIDING, ALL_ENTRIES, TOPK_ENTRIES = 0, 1, 2  # which compressed entries a query reads


@dataclass(frozen=True)
class SparseLaunch:
    block_h: int  # query heads per program
    block_n: int  # keys per tile
    head_dim_pad: int
    num_warps: int


def launch_policy(num_heads: int, head_dim: int) -> SparseLaunch:
    """Pure function of the layer's shape: tiles of about 8192 elements (heads x head_dim for the queries and the
    accumulator, keys x head_dim for a key tile), at least 16 on every tl.dot dimension."""
    if num_heads < 1:
        raise ValueError(f"num_heads={num_heads} must be >= 1")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} must be in [1, {MAX_HEAD_DIM}]")
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_h = min(max(16, triton.next_power_of_2(num_heads)), max(16, 8192 // dim_pad))
    block_n = max(16, min(64, 8192 // dim_pad))
    return SparseLaunch(block_h, block_n, dim_pad, num_warps=4 if dim_pad <= 128 else 8)


@triton.jit
def _attend(q, k, ok, m, l, acc, scale, DOT_PRECISION: tl.constexpr):
    """One tile of keys k [BLOCK_N, D] (ok: which are visible) into the running (max, sum, accumulator)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: m starts at the sink
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=DOT_PRECISION)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _sparse_attention_kernel(q_ptr, kv_ptr, row_table_ptr, entry_ptr, entry_table_ptr, topk_ptr, req_ptr, pos_ptr,
                             sink_ptr, out_ptr, stride_qt, stride_qh, stride_kb, stride_ks, stride_rt, stride_eb,
                             stride_es, stride_et, stride_tk, stride_ot, stride_oh, scale,
                             NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, RATE: tl.constexpr, ENTRY_ROWS: tl.constexpr,
                             TOPK: tl.constexpr, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HEADS
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    req = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                other=0.0)
    m = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)
    l = tl.full((BLOCK_H,), 1.0, tl.float32)  # exp(sink - m) with m = sink
    acc = tl.zeros((BLOCK_H, HEAD_DIM_PAD), dtype=tl.float32)
    # The sliding window: positions (pos - WINDOW, pos] of the token rows.
    lo = tl.maximum(pos - WINDOW + 1, 0)
    for start in tl.range(0, WINDOW, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        k_pos = lo + j
        ok = (j < WINDOW) & (k_pos <= pos)
        block = tl.load(row_table_ptr + req * stride_rt + k_pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        k = tl.load(kv_ptr + block[:, None] * stride_kb + (k_pos % BLOCK_SIZE)[:, None] * stride_ks + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        m, l, acc = _attend(q, k, ok, m, l, acc, scale, DOT_PRECISION)
    # Compressed entries: entry w lives in the row w % ENTRY_ROWS of the block holding its window's last token.
    if MODE == 1:
        count = (pos + 1) // RATE  # the windows complete at pos
        for start in tl.range(0, count, BLOCK_N):
            w = start + tl.arange(0, BLOCK_N)
            ok = w < count
            block = tl.load(entry_table_ptr + req * stride_et + (w * RATE + RATE - 1) // BLOCK_SIZE, mask=ok,
                            other=0).to(tl.int64)
            k = tl.load(entry_ptr + block[:, None] * stride_eb + (w % ENTRY_ROWS)[:, None] * stride_es + d[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0)
            m, l, acc = _attend(q, k, ok, m, l, acc, scale, DOT_PRECISION)
    if MODE == 2:
        for start in tl.range(0, TOPK, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            w = tl.load(topk_ptr + t * stride_tk + j, mask=j < TOPK, other=-1).to(tl.int64)
            ok = w >= 0
            w = tl.maximum(w, 0)
            block = tl.load(entry_table_ptr + req * stride_et + (w * RATE + RATE - 1) // BLOCK_SIZE, mask=ok,
                            other=0).to(tl.int64)
            k = tl.load(entry_ptr + block[:, None] * stride_eb + (w % ENTRY_ROWS)[:, None] * stride_es + d[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0)
            m, l, acc = _attend(q, k, ok, m, l, acc, scale, DOT_PRECISION)
    out = acc / l[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class SparseKey:
    dtype: torch.dtype  # of q, the rows and the output
    num_heads: int
    head_dim: int
    window: int
    block_size: int
    rate: int  # 0: no compressed entries
    topk: int  # 0: every complete entry (with rate)
    launch: SparseLaunch

    @property
    def mode(self) -> int:
        return SLIDING if not self.rate else TOPK_ENTRIES if self.topk else ALL_ENTRIES


class SparseAttention(CompiledKernel):
    """out[t] = softmax over the sink and token t's keys (window rows, then its entries) of q[t] . key, times key."""
    parallel_compile = True

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def dispatch(self, *, num_heads: int, head_dim: int, window: int, block_size: int, rate: int, topk: int,
                 dtype: torch.dtype) -> SparseKey:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        if rate < 0 or topk < 0 or (topk and not rate):
            raise ValueError(f"rate={rate} and topk={topk} must be >= 0, topk only with a rate")
        if rate and block_size % rate and rate % block_size:
            raise ValueError(f"block_size={block_size} and rate={rate} must divide one another")
        return SparseKey(dtype, num_heads, head_dim, window, block_size, rate, topk,
                         launch_policy(num_heads, head_dim))

    def __call__(self, q: torch.Tensor, kv_rows: torch.Tensor, row_table: torch.Tensor, req_of_token: torch.Tensor,
                 positions: torch.Tensor, sinks: torch.Tensor, *, scale: float, window: int,
                 entries: torch.Tensor | None = None, entry_table: torch.Tensor | None = None, rate: int = 0,
                 topk: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 launch: SparseLaunch | None = None) -> torch.Tensor:
        """q [T, H, D] (unit stride on D); kv_rows [blocks, block_size, D] the token rows' key-values (unit stride on
        D), row_table [reqs, max_blocks] int32 by token position; req_of_token [T] int32 (each token's block-table
        row), positions [T] (int32 or int64); sinks [H] float32; window: a query sees positions (p - window, p].
        entries [entry_blocks, rows_per_block, D] with entry_table [reqs, max_blocks] int32 (by token position, as
        CompressedEntrySpec lays entries out) and rate: compressed entries, every complete one unless topk [T, k]
        int32 lists which (ascending or not, -1 skipped). Returns out [T, H, D] in q's dtype. `launch` overrides
        the policy (tests)."""
        tokens, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or kv_rows.stride(2) != 1 or kv_rows.dim() != 3 or kv_rows.shape[2] != head_dim:
            raise ValueError(f"q [T, H, D] and kv_rows [blocks, block_size, {head_dim}] need unit stride on D, got "
                             f"{tuple(q.shape)} {q.stride()} and {tuple(kv_rows.shape)} {kv_rows.stride()}")
        if kv_rows.dtype != q.dtype:
            raise ValueError(f"kv_rows must be {q.dtype}, got {kv_rows.dtype}")
        if sinks.shape != (num_heads,) or sinks.dtype != torch.float32:
            raise ValueError(f"sinks must be float32 [{num_heads}], got {sinks.dtype} {tuple(sinks.shape)}")
        if (entries is None) != (entry_table is None) or (entries is None) != (rate == 0):
            raise ValueError("entries, entry_table and rate come together")
        if entries is not None and (entries.dim() != 3 or entries.shape[2] != head_dim or entries.stride(2) != 1
                                    or entries.dtype != q.dtype):
            raise ValueError(f"entries must be [blocks, rows_per_block, {head_dim}] of {q.dtype} with unit stride "
                             f"on D, got {entries.dtype} {tuple(entries.shape)}")
        if topk is not None and (entries is None or topk.dim() != 2 or topk.shape[0] != tokens
                                 or topk.dtype != torch.int32 or topk.stride(1) != 1):
            raise ValueError(f"topk must be int32 [{tokens}, k] with unit stride, with entries")
        for name, t in (("row_table", row_table), ("entry_table", entry_table), ("req_of_token", req_of_token)):
            if t is not None and t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
        key = self.dispatch(num_heads=num_heads, head_dim=head_dim, window=window, block_size=kv_rows.shape[1],
                            rate=rate, topk=0 if topk is None else topk.shape[1], dtype=q.dtype)
        if launch is not None:
            key = SparseKey(**{**vars(key), "launch": launch})
        self.ensure(key)
        if out is None:
            out = torch.empty_like(q)
        if tokens:
            _launch(key, q, kv_rows, row_table, entries, entry_table, topk, req_of_token, positions, sinks, out,
                    scale, warmup=False)
        return out

    def compile(self, key: SparseKey) -> object:
        dev, h, d = self.device, key.num_heads, key.head_dim
        i32 = dict(dtype=torch.int32, device=dev)
        rows = torch.empty(1, key.block_size, d, dtype=key.dtype, device=dev)
        entries = (torch.empty(1, max(1, key.block_size // key.rate), d, dtype=key.dtype, device=dev) if key.rate
                   else None)
        return _launch(key, torch.empty(1, h, d, dtype=key.dtype, device=dev), rows, torch.zeros(1, 1, **i32),
                       entries, torch.zeros(1, 1, **i32) if key.rate else None,
                       torch.zeros(1, key.topk, **i32) if key.topk else None, torch.zeros(1, **i32),
                       torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(h, dtype=torch.float32, device=dev),
                       torch.empty(1, h, d, dtype=key.dtype, device=dev), 1.0, warmup=True)


def _launch(key: SparseKey, q, kv_rows, row_table, entries, entry_table, topk, req_of_token, positions, sinks, out,
            scale, warmup: bool):
    launch = key.launch
    e = entries if entries is not None else kv_rows
    et = entry_table if entry_table is not None else row_table
    tk = topk if topk is not None else row_table
    args = (q, kv_rows, row_table, e, et, tk, req_of_token, positions, sinks, out, q.stride(0), q.stride(1),
            kv_rows.stride(0), kv_rows.stride(1), row_table.stride(0), e.stride(0), e.stride(1), et.stride(0),
            tk.stride(0), out.stride(0), out.stride(1), scale)
    constexprs = dict(NUM_HEADS=key.num_heads, HEAD_DIM=key.head_dim, HEAD_DIM_PAD=launch.head_dim_pad,
                      BLOCK_H=launch.block_h, BLOCK_N=launch.block_n, WINDOW=key.window, BLOCK_SIZE=key.block_size,
                      RATE=max(key.rate, 1), ENTRY_ROWS=max(1, key.block_size // max(key.rate, 1)), TOPK=key.topk,
                      MODE=key.mode, DOT_PRECISION="ieee" if key.dtype == torch.float32 else "tf32",
                      num_warps=launch.num_warps)
    grid = (q.shape[0], triton.cdiv(key.num_heads, launch.block_h))
    if warmup:
        return _sparse_attention_kernel.warmup(*args, grid=grid, **constexprs)
    _sparse_attention_kernel[grid](*args, **constexprs)
    return out
