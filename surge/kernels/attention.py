"""Paged attention for mixed prefill + decode batches in one Triton launch, over a [num_blocks, block_size, Hkv, D]
cache; decode-only batches may split the KV sequence across programs (flash-decoding) and merge in a second launch.

One program owns a tile of BLOCK_Q query tokens x all query heads of one KV head (a GQA group), so each K/V tile it
loads serves the whole group. Loop bounds come from seq_lens and query_start_loc in device memory, and the grid from
the token and request counts, so a launch captured in a CUDA graph stays valid for any sequence lengths.
Compile-time variants: sliding window, logit soft-capping (Gemma 2), attention sinks (gpt-oss), an FP8 cache
(float8_e4m3fn keys and values, per-tensor scales: K/V tiles are widened to the query's dtype in registers, k_scale
joins the softmax scale and v_scale the output, both exact rewrites of dequantizing every element) and bidirectional
spans (Gemma 3's images: each query token sees keys up to max(its position, causal_end[token]), so an image's tokens
see each other both ways; mixed launches only, and only in steps that compute image tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from surge.kernels.reference import FP8_KV_DTYPE
from surge.kernels.warmup import CompiledKernel

LOG2E = 1.4426950408889634  # the kernel's softmax runs on exp2: logits are carried times log2(e)
_LOG2E = tl.constexpr(LOG2E)
# Triton's interpreter has no libdevice: soft-capping's tanh then comes from exp.
_LIBDEVICE_TANH = tl.constexpr(not triton.knobs.runtime.interpret)

# Decode: keep at least this many programs per SM before splitting the KV sequence (memory-bound: more warps in
# flight per SM hide latency), and never more than MAX_SPLITS pieces.
PROGRAMS_PER_SM = 4
MAX_SPLITS = 16
# Tiles are halved beyond this head size and for fp32, to stay inside registers and shared memory.
WIDE_HEAD_DIM = 128
# Mixed steps of at most this many tokens (a verification of a few drafts per request, a short follow-up turn on a
# long context) have too few query tiles to fill the GPU: they split the KV sequence too, as one request's decode
# would. On the H200 a k = 4 verification at batch 1 and context 512 (Qwen3-8B, one 64-row tile per KV head, 8
# programs) took 22 us per layer in attention against decode's 5 us with 16 splits.
FEW_TOKENS = 64


@dataclass(frozen=True)
class AttentionLaunch:
    """Every compile-time knob of one attention launch."""
    block_m: int  # rows of a tile: block_q query tokens x the (padded) query heads of one KV head
    block_q: int  # query tokens per tile
    block_n: int  # KV positions per inner-loop step
    num_warps: int
    num_stages: int
    num_splits: int  # > 1: split-KV; partial results merged by a second launch
    decode: bool  # one query token per request: tile i is request i, no search
    search: int = 0  # > 0: a tile finds its request in one load of this many query starts (few tokens), else bisects


def _num_splits(programs: int, num_sms: int) -> int:
    """Pieces of the KV sequence per tile: doubled until the launch has PROGRAMS_PER_SM programs per SM."""
    splits = 1
    while splits < MAX_SPLITS and programs * splits < PROGRAMS_PER_SM * num_sms:
        splits *= 2
    return splits


def launch_policy(*, decode_only: bool, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, num_sms: int, num_tokens: int | None = None) -> AttentionLaunch:
    """Pure function of the batch's kind and capacities: never of sequence lengths.

    decode_only: every request has one query token (the CUDA-graph case); num_seqs is then the (padded) batch size,
    i.e. the graph's capture size. A mixed batch of at most FEW_TOKENS tokens (num_tokens: the step's, a graph's
    capture size under graphs; None: more) splits the KV sequence as one request's decode would; larger ones use
    one launch without splits."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    group_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    fp32 = dtype == torch.float32
    wide = head_dim > WIDE_HEAD_DIM or fp32
    block_n = 32 if wide else 64
    num_stages = 2 if wide else 3
    num_warps = 8 if fp32 else 4  # fp32 dots run on FMA units: spread the tiles over more registers
    if decode_only:
        # tl.dot needs M >= 16: a decode tile is one token's query heads, padded.
        block_m = max(16, group_pad)
        return AttentionLaunch(block_m, 1, block_n, num_warps, num_stages,
                               num_splits=_num_splits(num_seqs * num_kv_heads, num_sms), decode=True)
    block_m = max(16 if fp32 else 32 if wide else 64, group_pad)
    block_q = block_m // group_pad
    if num_tokens is None or num_tokens > FEW_TOKENS:
        return AttentionLaunch(block_m, block_q, block_n, num_warps, num_stages, num_splits=1, decode=False)
    # A tile's request is among the first (tiles in the grid) rows, and its end one row further: one vector load of
    # that many query starts replaces the bisection's chain of dependent loads (8 for a 256-row graph), which on
    # tiles this short is most of a program's time. One width for every few-token step: one compiled variant.
    search = triton.next_power_of_2(FEW_TOKENS // block_q + FEW_TOKENS + 1)
    return AttentionLaunch(block_m, block_q, block_n, num_warps, num_stages,
                           num_splits=_num_splits(num_kv_heads, num_sms), decode=False, search=search)


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The request owning tile `q_block`: request i's tiles start at query_start_loc[i] // BLOCK_Q + i (an upper
    bound on the tiles before it), or exactly at query_start_loc[i] when BLOCK_Q == 1."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid)
        if BLOCK_Q > 1:
            first = first // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    if _LIBDEVICE_TANH:
        return libdevice.tanh(x)
    else:
        e = tl.exp(-2.0 * tl.abs(x))  # in (0, 1]: no overflow at any x
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)


# Values that change from step to step must not pick a variant (Triton specializes ints that are 1 or 16-aligned).
@triton.jit(do_not_specialize=["num_seqs", "window", "stride_bt"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        block_table_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, causal_end_ptr,
        num_seqs, qk_scale, window, softcap,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CACHE_BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SLIDING: tl.constexpr, DECODE: tl.constexpr, SEARCH: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FP8_KV: tl.constexpr, SPANS: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # request i owns token i: skip the search and its dependent loads
        req = q_block
        q_start = q_block
        q_len = 1
        tile_start = 0
    else:
        if SEARCH > 0:  # request i's first tile as _find_request counts it; a tile's request: the last at or before
            row = tl.arange(0, SEARCH)
            starts = tl.load(query_start_loc_ptr + row, mask=row <= num_seqs, other=0)
            if BLOCK_Q > 1:
                firsts = starts // BLOCK_Q + row
            else:
                firsts = starts
            req = tl.sum(((firsts <= q_block) & (row < num_seqs)).to(tl.int32), 0) - 1
            q_start = tl.sum(tl.where(row == req, starts, 0), 0)
            q_len = tl.sum(tl.where(row == req + 1, starts, 0), 0) - q_start
        else:
            req = _find_request(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
            q_start = tl.load(query_start_loc_ptr + req)
            q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        if BLOCK_Q > 1:
            first_block = q_start // BLOCK_Q + req
        else:
            first_block = q_start
        tile_start = (q_block - first_block) * BLOCK_Q  # first query token of this tile, within the request
        if tile_start >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    context_len = seq_len - q_len

    GROUP_PAD: tl.constexpr = BLOCK_M // BLOCK_Q
    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = context_len + tok
    dim = tl.arange(0, HEAD_DIM_PAD)
    if HEAD_DIM == HEAD_DIM_PAD:  # a mask the compiler sees as constant along D keeps loads vectorized
        dim_ok = tl.full([HEAD_DIM_PAD], 1, tl.int1)
    else:
        dim_ok = dim < HEAD_DIM
    token = (q_start + tok).to(tl.int64)
    if SPANS:  # the last key each query sees: its own position, or its image's last token
        q_end = tl.maximum(q_pos, tl.load(causal_end_ptr + token, mask=row_ok, other=0))
    else:
        q_end = q_pos
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dim[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Positions this tile can see: up to its last query (causal) or the furthest image end among its queries, from
    # its first query's window start.
    if DECODE:
        kv_end = seq_len
    else:
        kv_end = context_len + tl.minimum(tile_start + BLOCK_Q, q_len)
        if SPANS:
            kv_end = tl.minimum(tl.maximum(kv_end, tl.max(tl.where(row_ok, q_end + 1, 0), 0)), seq_len)
    kv_begin = 0
    if SLIDING:
        kv_begin = tl.maximum(context_len + tile_start - window + 1, 0)
    tile_lo = kv_begin // BLOCK_N
    tile_hi = tl.cdiv(kv_end, BLOCK_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

    if FP8_KV:  # q . (k * k_scale) = (q . k) * k_scale: the scale joins the softmax scale, not every element
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # The sink is one more key, of logit sinks[head] and value zero, seen before the first tile. Only the first
        # split holds it, so the merge (a sum of the splits' denominators) counts it once.
        if split == 0:
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * _LOG2E
            l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        # Slots at or past seq_len, or before the window's start (blocks a sliding group freed or never filled on a
        # prefix hit), are never read: they may hold anything, NaN included, and 0 * NaN would reach the output.
        pos_ok = (pos < kv_end) & (pos >= kv_begin)
        block_id = tl.load(table_row + pos // CACHE_BLOCK, mask=pos_ok, other=0)
        slot = block_id.to(tl.int64) * stride_cb + (pos % CACHE_BLOCK) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + slot[None, :] + dim[:, None], mask=pos_ok[None, :] & dim_ok[:, None], other=0.0)
        if FP8_KV:  # exact: every float8_e4m3fn value is a bfloat16, float16 and float32 value
            k = k.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # log2 domain: qk_scale includes log2(e)
        if SOFTCAP:  # cap * tanh(s / cap) of the natural score: with s and softcap both times log2(e), the same
            s = softcap * _tanh(s / softcap)
        visible = pos[None, :] <= q_end[:, None]
        if SLIDING:  # the window is behind the query, whatever it sees ahead
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at zero
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + dim[None, :], mask=pos_ok[:, None] & dim_ok[None, :], other=0.0)
        if FP8_KV:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if FP8_KV:  # sum_j p_j (v_j * v_scale) = (sum_j p_j v_j) * v_scale, split partials alike (the merge is linear)
        acc = acc * tl.load(v_scale_ptr)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dim[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        num_heads = tl.num_programs(1) * GROUP
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dim[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, query_start_loc_ptr, num_seqs,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SKIP_PADDING: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # A mixed graph's padding tokens (past the last request's end) have no partials: skip reading 16 splits of
    # garbage for each (a k = 4 verification at batch 1 in a 16-token graph: 11 of its 16); no one reads their rows.
    if SKIP_PADDING:
        if token >= tl.load(query_start_loc_ptr + num_seqs):
            return
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + part * 2)
    l = tl.load(part_ml_ptr + part * 2 + 1)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # splits that saw nothing weigh 0
    total = tl.sum(l * weight, 0)
    dim = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dim[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dim, out.to(out_ptr.dtype.element_ty),
             mask=dim < HEAD_DIM)


@dataclass(frozen=True)
class AttentionKey:
    """What a compiled variant depends on: dtypes, head geometry, cache block size, window, soft-cap, sinks and FP8
    cache on/off, launch."""
    dtype: torch.dtype
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sliding: bool
    launch: AttentionLaunch
    softcap: bool = False  # scores soft-capped: cap * tanh(s / cap)
    sinks: bool = False  # a per-head sink logit joins the softmax denominator
    fp8_kv: bool = False  # the cache holds float8_e4m3fn with per-tensor scales (else the query's dtype)
    spans: bool = False  # queries see up to max(position, causal_end): bidirectional image spans (mixed launches)


class PagedAttention(CompiledKernel):
    parallel_compile = True

    def __init__(self, device: torch.device, num_sms: int) -> None:
        super().__init__()
        self.device, self.num_sms = device, num_sms

    def dispatch(self, *, decode_only: bool, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, sliding: bool, num_tokens: int | None = None,
                 softcap: bool = False, sinks: bool = False, fp8_kv: bool = False, spans: bool = False
                 ) -> AttentionKey:
        if spans and decode_only:
            raise ValueError("causal_end (bidirectional spans) is for mixed launches: a decode row is causal")
        launch = launch_policy(decode_only=decode_only, num_seqs=num_seqs, num_q_heads=num_q_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, num_sms=self.num_sms,
                               num_tokens=num_tokens)
        return AttentionKey(dtype, num_q_heads, num_kv_heads, head_dim, block_size, sliding, launch, softcap, sinks,
                            fp8_kv, spans)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, num_seqs: int, decode_only: bool,
                 sliding_window: int | None, scale: float, out: torch.Tensor | None = None,
                 logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 causal_end: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (same strides), in q's dtype or
        float8_e4m3fn (then k_scale, v_scale: float32 scalar tensors, a stored x stands for x * scale);
        block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] (tokens in the cache after this step,
        including this step's); query_start_loc: [num_seqs + 1] int32. decode_only: every request has exactly one
        query token. logit_softcap: scores s -> cap * tanh(s / cap) before masking; sinks: [Hq] float32, a logit
        per query head in each softmax's denominator. causal_end: [T] int32, a query sees keys up to max(its position,
        causal_end) (never past its sequence's end); mixed launches only."""
        num_tokens, num_q_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if sinks is not None and (sinks.shape != (num_q_heads,) or sinks.dtype != torch.float32):
            raise ValueError(f"sinks {tuple(sinks.shape)} {sinks.dtype} must be [{num_q_heads}] float32: one logit "
                             "per query head")
        fp8_kv = k_cache.dtype == FP8_KV_DTYPE
        if k_cache.dtype not in (q.dtype, FP8_KV_DTYPE) or (fp8_kv and (k_scale is None or v_scale is None)):
            raise ValueError(f"a {k_cache.dtype} KV cache under {q.dtype} queries: the cache holds the queries' dtype, "
                             "or float8_e4m3fn with k_scale and v_scale")
        key = self.dispatch(decode_only=decode_only, num_seqs=num_seqs, num_q_heads=num_q_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=q.dtype,
                            sliding=sliding_window is not None, num_tokens=num_tokens,
                            softcap=logit_softcap is not None, sinks=sinks is not None, fp8_kv=fp8_kv,
                            spans=causal_end is not None)
        self.ensure(key)
        if out is None:
            out = torch.empty_like(q)
        _launch(key, q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, num_tokens, num_seqs,
                sliding_window or 0, scale, logit_softcap or 0.0, sinks, k_scale, v_scale, causal_end)
        return out

    def compile(self, key: AttentionKey) -> object:
        """Compiles without running, on tiny tensors with the runtime's dtypes and stride divisibility."""
        hq, hkv, d, bs = key.num_q_heads, key.num_kv_heads, key.head_dim, key.block_size
        dev = self.device
        q = torch.empty(1, (hq + 2 * hkv) * d, dtype=key.dtype, device=dev)[:, :hq * d].view(1, hq, d)
        kv_cache = torch.empty(2, 2, bs, hkv, d, dtype=FP8_KV_DTYPE if key.fp8_kv else key.dtype, device=dev)
        kv_scale = torch.ones((), dtype=torch.float32, device=dev) if key.fp8_kv else None
        table = torch.zeros(1, 16, dtype=torch.int32, device=dev)
        seq_lens = torch.ones(1, dtype=torch.int64, device=dev)
        query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        sinks = torch.zeros(hq, dtype=torch.float32, device=dev) if key.sinks else None
        causal_end = torch.zeros(1, dtype=torch.int32, device=dev) if key.spans else None
        return _launch(key, q, kv_cache[0], kv_cache[1], torch.empty(1, hq, d, dtype=key.dtype, device=dev), table,
                       seq_lens, query_start_loc, 1, 1, 1 if key.sliding else 0, d ** -0.5,
                       50.0 if key.softcap else 0.0, sinks, kv_scale, kv_scale, causal_end, warmup=True)


def launch_constexprs(key: AttentionKey) -> dict:
    """The attention kernel's compile-time arguments for a key, num_warps and num_stages included."""
    launch = key.launch
    return dict(GROUP=key.num_q_heads // key.num_kv_heads, HEAD_DIM=key.head_dim,
                HEAD_DIM_PAD=max(16, triton.next_power_of_2(key.head_dim)), CACHE_BLOCK=key.block_size,
                BLOCK_M=launch.block_m, BLOCK_Q=launch.block_q, BLOCK_N=launch.block_n, NUM_SPLITS=launch.num_splits,
                SLIDING=key.sliding, DECODE=launch.decode, SEARCH=launch.search, SOFTCAP=key.softcap,
                HAS_SINKS=key.sinks, FP8_KV=key.fp8_kv, SPANS=key.spans,
                DOT_PRECISION="ieee" if key.dtype == torch.float32 else "tf32",
                num_warps=launch.num_warps, num_stages=launch.num_stages)


def _launch(key: AttentionKey, q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, num_tokens: int,
            num_seqs: int, window: int, scale: float, softcap: float = 0.0, sinks: torch.Tensor | None = None,
            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
            causal_end: torch.Tensor | None = None, warmup: bool = False):
    launch = key.launch
    head_dim_pad = max(16, triton.next_power_of_2(key.head_dim))
    assert tuple(k_cache.stride()) == tuple(v_cache.stride()), "K and V caches must share a layout"
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
    if launch.block_q == 1:
        grid = (num_tokens, key.num_kv_heads, launch.num_splits)
    else:
        # Request i's tiles start at query_start_loc[i] // block_q + i; requests without tokens (a graph's padding
        # rows) come after every request with some, so at most num_tokens of them own tiles. A grid sized by the
        # request capacity instead ran 257 x 8 x 16 programs for a 16-token graph of 256 rows, nearly all exiting
        # at once: on the H200 a k = 4 verification step at batch 1 took 7.2 ms instead of 6.0.
        grid = (num_tokens // launch.block_q + min(num_seqs, num_tokens), key.num_kv_heads, launch.num_splits)
    split = launch.num_splits > 1
    if split:
        parts = num_tokens * key.num_q_heads * launch.num_splits
        part_acc = torch.empty(parts * head_dim_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(parts * 2, dtype=torch.float32, device=q.device)
    else:  # the kernel never touches them without splits: any float32 pointer will do
        part_acc = part_ml = torch.empty(0, dtype=torch.float32, device=q.device)
    assert (sinks is not None) == key.sinks and (softcap > 0) == key.softcap
    assert not key.fp8_kv or (k_scale is not None and v_scale is not None)
    assert (causal_end is not None) == key.spans
    args = (q, k_cache, v_cache, out, part_acc, part_ml, block_table, seq_lens, query_start_loc,
            sinks if key.sinks else part_ml,  # without sinks never read: any float32 pointer
            k_scale if key.fp8_kv else part_ml, v_scale if key.fp8_kv else part_ml,
            causal_end if key.spans else query_start_loc,  # without spans never read: any int32 pointer
            num_seqs, scale * LOG2E, window, softcap * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0))
    constexprs = launch_constexprs(key)
    merge_args = (part_acc, part_ml, out, out.stride(0), out.stride(1), query_start_loc, num_seqs)
    merge_constexprs = dict(HEAD_DIM=key.head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=launch.num_splits,
                            SKIP_PADDING=not launch.decode, num_warps=4)
    if warmup:
        compiled = [_paged_attention_kernel.warmup(*args, grid=grid, **constexprs)]
        if split:
            compiled.append(_merge_splits_kernel.warmup(*merge_args, grid=(1, key.num_q_heads), **merge_constexprs))
        return compiled
    _paged_attention_kernel[grid](*args, **constexprs)
    if split:
        _merge_splits_kernel[(num_tokens, key.num_q_heads)](*merge_args, **merge_constexprs)
    return out
