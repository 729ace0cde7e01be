"""Multi-head latent attention (DeepSeek V2/V3) over the paged latent cache, up-projections absorbed: each query head
arrives in latent space ([q_nope W_UK | q_pe], kv_lora_rank + qk_rope_head_dim values), scores against the cached
rows [kv_c | k_pe] of its request, and leaves as the probability-weighted latent (W_UV is applied after). One load of
a KV tile serves as keys (all of it) and values (its latent part), for every query head of the tile: the cache is
read once per head tile, kv_lora_rank + qk_rope_head_dim values a position (the point of the latent cache).

One program owns BLOCK_Q query tokens x BLOCK_H query heads (one token's in decode). Mixed batches (prefill chunks,
decodes) run in the same launch with a causal mask; decode batches, and mixed steps of a few tokens, may split the KV
sequence across programs and merge in a second launch (the paged attention kernel's merge: same partial layout).
Every length is read from device memory and the grid comes from token and request counts, so a launch captured in a
CUDA graph stays valid for any sequence lengths. Requests with no cached context and at least `expand_min` new tokens
(fresh prompts, which the caller attends to with keys and values expanded per head) are skipped: their rows are left
as they were.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.attention import FEW_TOKENS, LOG2E, _find_request, _merge_splits_kernel, _num_splits
from surge.kernels.warmup import CompiledKernel

# A tile's float32 accumulator is [BLOCK_Q * BLOCK_H, kv_lora_rank]: 32 rows of 512 fill 64 registers a thread over
# 8 warps, as many as a register file can give beside the query tile. float32 tiles (no half-precision MMA) take 16.
MAX_TILE_ROWS = 32
FP32_TILE_ROWS = 16


@dataclass(frozen=True)
class MLALaunch:
    """Every compile-time knob of one MLA launch."""
    block_h: int  # query heads per tile, padded to the MMA minimum of 16
    block_q: int  # query tokens per tile (1 in decode)
    block_n: int  # KV positions per inner-loop step
    num_warps: int
    num_stages: int
    num_splits: int  # > 1: split-KV, partials merged by a second launch
    decode: bool  # one query token per request: tile i is request i, no search


def mla_launch_policy(*, decode_only: bool, num_seqs: int, num_heads: int, dtype: torch.dtype, num_sms: int,
                      num_tokens: int | None = None) -> MLALaunch:
    """Pure function of the batch's kind and capacities, never of sequence lengths (CUDA graphs stay valid).

    decode_only: every request has one query token; num_seqs is then the (padded) batch size. A mixed batch of at
    most FEW_TOKENS tokens (num_tokens: the step's, a graph's capture size; None: more) splits the KV sequence as one
    request's decode would; larger ones run one launch without splits."""
    if num_heads < 1:
        raise ValueError(f"num_heads={num_heads} must be positive")
    fp32 = dtype == torch.float32
    rows = FP32_TILE_ROWS if fp32 else MAX_TILE_ROWS
    heads_pad = max(16, triton.next_power_of_2(num_heads))
    block_h = min(heads_pad, rows)
    head_tiles = triton.cdiv(num_heads, block_h)
    block_n = 16 if fp32 else 32
    num_warps = 8 if fp32 or block_h > 16 else 4
    if decode_only:
        return MLALaunch(block_h, 1, block_n, num_warps, 2,
                         num_splits=_num_splits(num_seqs * head_tiles, num_sms), decode=True)
    block_q = rows // block_h
    num_warps = 8 if fp32 or block_h * block_q > 16 else 4
    splits = 1 if num_tokens is None or num_tokens > FEW_TOKENS else _num_splits(head_tiles, num_sms)
    return MLALaunch(block_h, block_q, block_n, num_warps, 2, num_splits=splits, decode=False)


# Values that change from step to step must not pick a variant (Triton specializes ints that are 1 or 16-aligned).
@triton.jit(do_not_specialize=["num_seqs", "expand_min", "stride_bt", "stride_qh", "stride_oh", "stride_pt",
                             "stride_ph"])
def _mla_attention_kernel(
        q_lat_ptr, q_pe_ptr, cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        block_table_ptr, seq_lens_ptr, query_start_loc_ptr, num_seqs, expand_min, qk_scale,
        stride_qt, stride_qh, stride_pt, stride_ph, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
        NUM_HEADS: tl.constexpr, LORA: tl.constexpr, LORA_PAD: tl.constexpr, ROPE: tl.constexpr,
        ROPE_PAD: tl.constexpr, CACHE_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DECODE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    q_block = tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # request i owns token i
        req = q_block
        q_start = q_block
        q_len = 1
        tile_start = 0
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
    if not DECODE:
        if (seq_len == q_len) & (q_len >= expand_min):  # a fresh prompt the caller expands
            return
    context_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // BLOCK_H
    head = head_tile * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < q_len) & (head < NUM_HEADS)
    q_pos = context_len + tok
    token = (q_start + tok).to(tl.int64)
    lat = tl.arange(0, LORA_PAD)
    rope = tl.arange(0, ROPE_PAD)
    # Masks the compiler sees as constant along a row keep the cache loads vectorized (512 and 64: no padding).
    if LORA == LORA_PAD:
        lat_ok = tl.full([LORA_PAD], 1, tl.int1)
    else:
        lat_ok = lat < LORA
    if ROPE == ROPE_PAD:
        rope_ok = tl.full([ROPE_PAD], 1, tl.int1)
    else:
        rope_ok = rope < ROPE
    q_lat = tl.load(q_lat_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + lat[None, :],
                    mask=row_ok[:, None] & lat_ok[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + token[:, None] * stride_pt + head[:, None] * stride_ph + rope[None, :],
                   mask=row_ok[:, None] & rope_ok[None, :], other=0.0)

    if DECODE:
        kv_end = seq_len
    else:  # causal: up to the tile's last query
        kv_end = context_len + tl.minimum(tile_start + BLOCK_Q, q_len)
    tile_lo = 0
    tile_hi = tl.cdiv(kv_end, BLOCK_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tile_hi, NUM_SPLITS)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LORA_PAD], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        # Slots at or past the tile's end are never read: they may hold anything, NaN included (0 * NaN is NaN).
        pos_ok = pos < kv_end
        block_id = tl.load(table_row + pos // CACHE_BLOCK, mask=pos_ok, other=0)
        slot = block_id.to(tl.int64) * stride_cb + (pos % CACHE_BLOCK) * stride_cs
        kv_c = tl.load(cache_ptr + slot[:, None] + lat[None, :], mask=pos_ok[:, None] & lat_ok[None, :], other=0.0)
        k_pe = tl.load(cache_ptr + slot[:, None] + LORA + rope[None, :], mask=pos_ok[:, None] & rope_ok[None, :],
                       other=0.0)
        s = tl.dot(q_lat, tl.trans(kv_c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION) * qk_scale  # log2 domain
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at zero
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv_c.dtype), kv_c, input_precision=DOT_PRECISION)  # values: latents
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + lat[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & lat_ok[None, :])
    else:  # the layout _merge_splits_kernel reads: [token, head, split] rows of LORA_PAD, then (m, l) pairs
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * LORA_PAD + lat[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _write_mla_cache_kernel(kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr, stride_ct, stride_pt, stride_cb,
                            stride_cs, LORA: tl.constexpr, LORA_PAD: tl.constexpr, ROPE: tl.constexpr,
                            ROPE_PAD: tl.constexpr, CACHE_BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token of a CUDA-graph batch
        return
    row = cache_ptr + (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_cs
    lat = tl.arange(0, LORA_PAD)
    tl.store(row + lat, tl.load(kv_c_ptr + token * stride_ct + lat, mask=lat < LORA), mask=lat < LORA)
    rope = tl.arange(0, ROPE_PAD)
    tl.store(row + LORA + rope, tl.load(k_pe_ptr + token * stride_pt + rope, mask=rope < ROPE), mask=rope < ROPE)


def write_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_c: [T, L], k_pe: [T, R] (unit stride on the last dimension); cache: [num_blocks, block_size, 1, L + R];
    slot_mapping: [T], negative for tokens to skip. Row slot <- [kv_c | k_pe]."""
    num_tokens, lora = kv_c.shape
    rope = k_pe.shape[1]
    if num_tokens == 0:
        return
    assert kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1 and cache.stride(-1) == 1
    assert cache.shape[-1] == lora + rope and cache.dtype == kv_c.dtype == k_pe.dtype
    _write_mla_cache_kernel[(num_tokens,)](
        kv_c, k_pe, cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        LORA=lora, LORA_PAD=triton.next_power_of_2(lora), ROPE=rope, ROPE_PAD=triton.next_power_of_2(rope),
        CACHE_BLOCK=cache.shape[1], num_warps=4)


@dataclass(frozen=True)
class MLAKey:
    """What a compiled variant depends on: dtype, head count, latent and rope sizes, cache block size, launch."""
    dtype: torch.dtype
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    block_size: int
    launch: MLALaunch


class MLAPagedAttention(CompiledKernel):
    parallel_compile = True

    def __init__(self, device: torch.device, num_sms: int) -> None:
        super().__init__()
        self.device, self.num_sms = device, num_sms

    def dispatch(self, *, decode_only: bool, num_seqs: int, num_heads: int, kv_lora_rank: int,
                 qk_rope_head_dim: int, block_size: int, dtype: torch.dtype,
                 num_tokens: int | None = None) -> MLAKey:
        launch = mla_launch_policy(decode_only=decode_only, num_seqs=num_seqs, num_heads=num_heads, dtype=dtype,
                                   num_sms=self.num_sms, num_tokens=num_tokens)
        return MLAKey(dtype, num_heads, kv_lora_rank, qk_rope_head_dim, block_size, launch)

    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, num_seqs: int, decode_only: bool,
                 scale: float, out: torch.Tensor | None = None, expand_min: int | None = None) -> torch.Tensor:
        """q_lat: [T, H, L] (queries' nope channels through W_UK); q_pe: [T, H, R] (rotated); any token and head
        strides, unit stride on the last dimension. cache: [num_blocks, block_size, 1, L + R] in q's dtype;
        block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] (tokens in the cache after this step);
        query_start_loc: [num_seqs + 1] int32. expand_min: requests with no cached context and at least this many
        new tokens are skipped (None: none). Returns the attention-weighted latents [T, H, L] (into `out`)."""
        num_tokens, num_heads, lora = q_lat.shape
        rope = q_pe.shape[2]
        if cache.dtype != q_lat.dtype or q_pe.dtype != q_lat.dtype:
            raise ValueError(f"an MLA cache of {cache.dtype} under {q_lat.dtype} queries: the cache holds the "
                             "queries' dtype")
        if cache.shape[2:] != (1, lora + rope):
            raise ValueError(f"an MLA cache of shape {tuple(cache.shape)} for kv_lora_rank={lora}, "
                             f"qk_rope_head_dim={rope}: expected [num_blocks, block_size, 1, {lora + rope}]")
        key = self.dispatch(decode_only=decode_only, num_seqs=num_seqs, num_heads=num_heads, kv_lora_rank=lora,
                            qk_rope_head_dim=rope, block_size=cache.shape[1], dtype=q_lat.dtype,
                            num_tokens=num_tokens)
        self.ensure(key)
        if out is None:
            out = torch.empty_like(q_lat)
        _launch(key, q_lat, q_pe, cache, out, block_table, seq_lens, query_start_loc, num_tokens, num_seqs, scale,
                _NEVER if expand_min is None else expand_min)
        return out

    def compile(self, key: MLAKey) -> object:
        """Compiles without running, on tiny tensors laid out as the runtime's (q_lat from a batched matmul, q_pe a
        view of the projected queries)."""
        h, lora, rope, dev = key.num_heads, key.kv_lora_rank, key.qk_rope_head_dim, self.device
        q_lat = torch.empty(h, 1, lora, dtype=key.dtype, device=dev).transpose(0, 1)
        q_pe = torch.empty(1, h, 2 * rope, dtype=key.dtype, device=dev)[..., rope:]
        cache = torch.empty(2, key.block_size, 1, lora + rope, dtype=key.dtype, device=dev)
        out = torch.empty(h, 1, lora, dtype=key.dtype, device=dev).transpose(0, 1)
        table = torch.zeros(1, 16, dtype=torch.int32, device=dev)
        seq_lens = torch.ones(1, dtype=torch.int32, device=dev)
        query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        return _launch(key, q_lat, q_pe, cache, out, table, seq_lens, query_start_loc, 1, 1, 1.0, _NEVER, warmup=True)


_NEVER = 2 ** 31 - 1  # an expand_min no request reaches


def _launch(key: MLAKey, q_lat, q_pe, cache, out, block_table, seq_lens, query_start_loc, num_tokens: int,
            num_seqs: int, scale: float, expand_min: int, warmup: bool = False):
    launch = key.launch
    lora_pad = max(16, triton.next_power_of_2(key.kv_lora_rank))
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and out.stride(-1) == 1 and cache.stride(-1) == 1
    head_tiles = triton.cdiv(key.num_heads, launch.block_h)
    if launch.decode:
        grid = (num_tokens, head_tiles, launch.num_splits)
    else:  # request i's tiles start at query_start_loc[i] // block_q + i (as the paged attention kernel counts)
        grid = (num_tokens // launch.block_q + min(num_seqs, num_tokens), head_tiles, launch.num_splits)
    split = launch.num_splits > 1
    if split:
        parts = num_tokens * key.num_heads * launch.num_splits
        part_acc = torch.empty(parts * lora_pad, dtype=torch.float32, device=q_lat.device)
        part_ml = torch.empty(parts * 2, dtype=torch.float32, device=q_lat.device)
    else:  # never touched without splits
        part_acc = part_ml = torch.empty(0, dtype=torch.float32, device=q_lat.device)
    args = (q_lat, q_pe, cache, out, part_acc, part_ml, block_table, seq_lens, query_start_loc, num_seqs, expand_min,
            scale * LOG2E, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0),
            out.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0))
    constexprs = dict(NUM_HEADS=key.num_heads, LORA=key.kv_lora_rank, LORA_PAD=lora_pad, ROPE=key.qk_rope_head_dim,
                      ROPE_PAD=max(16, triton.next_power_of_2(key.qk_rope_head_dim)), CACHE_BLOCK=key.block_size,
                      BLOCK_H=launch.block_h, BLOCK_Q=launch.block_q, BLOCK_N=launch.block_n,
                      NUM_SPLITS=launch.num_splits, DECODE=launch.decode,
                      DOT_PRECISION="ieee" if key.dtype == torch.float32 else "tf32",
                      num_warps=launch.num_warps, num_stages=launch.num_stages)
    merge_args = (part_acc, part_ml, out, out.stride(0), out.stride(1), query_start_loc, num_seqs)
    merge_constexprs = dict(HEAD_DIM=key.kv_lora_rank, HEAD_DIM_PAD=lora_pad, NUM_SPLITS=launch.num_splits,
                            SKIP_PADDING=not launch.decode, num_warps=4)
    if warmup:
        compiled = [_mla_attention_kernel.warmup(*args, grid=grid, **constexprs)]
        if split:
            compiled.append(_merge_splits_kernel.warmup(*merge_args, grid=(1, key.num_heads), **merge_constexprs))
        return compiled
    _mla_attention_kernel[grid](*args, **constexprs)
    if split:
        _merge_splits_kernel[(num_tokens, key.num_heads)](*merge_args, **merge_constexprs)
    return out
