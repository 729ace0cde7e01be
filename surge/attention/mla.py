"""Multi-head latent attention (DeepSeek V2/V3) over a latent KV cache: in plain torch (the CPU path, and the
reference), and absorbed through the Triton kernel (surge/kernels/mla_attention.py: the CUDA path).

A token caches one row [kv_c | k_pe]: its normed latent (kv_lora_rank L) and its rotated rope key (R), shared by
every head. kv_b_proj's weight W [H * (nope + v), L] gives head h's keys and values: k_h = [W_UK_h kv_c | k_pe],
v_h = W_UV_h kv_c. Two ways to attend, equal in exact arithmetic:
- expanded (rows with several queries: prefill, chunked or after a prefix hit): the context's latents through W into
  per-head keys (nope + R) and values (v), then attention: many queries share each expansion;
- absorbed (decode rows): q_h's nope channels through W_UK_h^T into latent space, scores straight against the cached
  rows ([q_lat | q_pe] . [kv_c | k_pe]), the probabilities weight the cached latents, and W_UV_h maps the result to v:
  L + R values read per position, nothing expanded (the point of the latent cache).
The Triton path absorbs every row, prefill chunks included (the kernel masks causally), except the fresh prompts of an
eager step, which it expands: the kernel reads every length from device memory, so its steps can be captured in CUDA
graphs, mixed ones too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from surge.attention.backend import AttentionMetadata, AttentionParams


@dataclass
class MLADecodePlan:
    """The decode rows of one step: what to gather and the mask, shared by every MLA layer of the step."""
    token_idx: torch.Tensor | None  # [R] token of each decode row; None: every row decodes, in order
    slots: torch.Tensor  # [R, Lmax] cache row of each visible position, or the row's current token's (masked)
    mask: torch.Tensor | None  # [R, 1, Lmax] additive, 0 visible / -inf; None: every position visible


def mla_forward(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, params: AttentionParams, kv_b_weight: torch.Tensor,
                absorb: bool | None = None) -> torch.Tensor:
    """AttentionBackend.forward_mla's contract. absorb: None, decode rows absorbed and the others expanded; True or
    False, every row one way (tests: both must equal the dense reference)."""
    lora, rope = params.kv_lora_rank, params.qk_rope_head_dim
    num_heads, nope, v_dim = q.shape[1], params.head_dim - rope, params.head_dim_v
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"an MLA cache of {kv_cache.dtype} for {q.dtype} activations: only a cache of the model's "
                         "dtype is supported (kv_cache_dtype='auto')")
    block_size = kv_cache.shape[2]
    rows = kv_cache.view(-1, lora + rope)  # one row per slot
    rows.index_copy_(0, meta.slot_mapping, torch.cat((kv_c, k_pe), dim=-1))
    w = kv_b_weight.view(num_heads, nope + v_dim, lora)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, L], [H, v, L]
    out = q.new_empty(q.shape[0], num_heads, v_dim)
    qsl = meta.query_start_loc
    lengths = [qsl[r + 1] - qsl[r] for r in range(meta.num_reqs)]
    decode = [r for r, n in enumerate(lengths) if n == 1] if absorb is None else []
    if decode:
        plan = _decode_plan(meta, decode, block_size)
        q_rows = q if plan.token_idx is None else q.index_select(0, plan.token_idx)
        o = _absorbed(q_rows, rows.index_select(0, plan.slots.reshape(-1)).view(*plan.slots.shape, -1), plan.mask,
                      w_uk, w_uv, params.scale, lora)
        if plan.token_idx is None:
            return o
        out[plan.token_idx] = o
    for r, n in enumerate(lengths):
        if n == 0 or (absorb is None and n == 1):
            continue
        start, seq_len = qsl[r], meta.seq_lens[r]
        k_pos = torch.arange(seq_len, device=q.device)
        ctx = rows.index_select(0, _slots_of(meta.block_table[r].long(), k_pos, block_size))  # [S, L + R]
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [n, S]
        if absorb:
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
            out[start:start + n] = _absorbed(q[start:start + n], ctx.expand(n, -1, -1), mask, w_uk, w_uv,
                                             params.scale, lora)
        else:
            out[start:start + n] = _expanded(q[start:start + n], ctx, visible, kv_b_weight, params.scale, lora,
                                             nope, v_dim)
    return out


# A fresh prompt (nothing cached before it) of at least this many tokens is attended to with keys and values expanded
# per head from its own rows (flash attention over qk_head_dim keys), not absorbed: in latent space every query tile
# reloads the whole context and dots kv_lora_rank + qk_rope_head_dim channels per pair instead of qk_head_dim.
EXPAND_MIN_TOKENS = 64


def mla_forward_triton(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, params: AttentionParams, kv_b_weight: torch.Tensor,
                       kernel) -> torch.Tensor:
    """mla_forward's contract through the Triton kernel (`kernel`: the device's MLAPagedAttention): W_UK into the
    queries (one batched matmul over the heads), the kernel over the cached rows, W_UV into its latent output. The
    kernel reads lengths on the device only, so a captured step replays for any lengths; an eager step's fresh prompts
    of EXPAND_MIN_TOKENS or more (chosen from host lengths: a capture's metadata has none) run expanded instead.
    A request's host length is exact or, scheduled ahead of a verdict, an upper bound that still exceeds its new
    tokens: either way only truly fresh prompts are picked, the same ones the kernel skips by its device lengths."""
    from surge.kernels.mla_attention import write_mla_cache

    lora = params.kv_lora_rank
    num_heads, nope, v_dim = q.shape[1], params.head_dim - params.qk_rope_head_dim, params.head_dim_v
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"an MLA cache of {kv_cache.dtype} for {q.dtype} activations: only a cache of the model's "
                         "dtype is supported (kv_cache_dtype='auto')")
    cache = kv_cache[0]  # [num_blocks, block_size, 1, L + R]
    write_mla_cache(kv_c, k_pe, cache, meta.slot_mapping)
    w = kv_b_weight.view(num_heads, nope + v_dim, lora)
    qsl = meta.query_start_loc
    fresh = [] if q.is_cuda and torch.cuda.is_current_stream_capturing() else [
        (qsl[r], qsl[r + 1]) for r, seq_len in enumerate(meta.seq_lens)
        if seq_len == qsl[r + 1] - qsl[r] >= EXPAND_MIN_TOKENS]
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope]).transpose(0, 1)  # [T, H, L], head-major memory
    o_lat = q.new_empty(num_heads, q.shape[0], lora).transpose(0, 1)
    kernel(q_lat, q[..., nope:], cache, meta.block_table, meta.seq_lens_t, meta.query_start_loc_t,
           num_seqs=meta.num_reqs, decode_only=meta.decode_only, scale=params.scale, out=o_lat,
           expand_min=EXPAND_MIN_TOKENS if fresh else None)
    out = torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1)  # [T, H, v]
    for start, end in fresh:  # rows the kernel skipped
        out[start:end] = _expanded_fresh(q[start:end], kv_c[start:end], k_pe[start:end], kv_b_weight, params.scale,
                                         nope, v_dim)
    return out


def _expanded_fresh(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor,
                    scale: float, nope: int, v_dim: int) -> torch.Tensor:
    """A fresh prompt's queries [n, H, nope + R] over its own rows, causal; [n, H, v]. The values are zero-padded to
    the keys' head size, which flash attention kernels require of the three."""
    num_heads, qk_dim = q.shape[1], q.shape[2]
    kv = F.linear(kv_c, kv_b_weight).view(kv_c.shape[0], num_heads, nope + v_dim)
    keys = torch.cat((kv[..., :nope], k_pe[:, None, :].expand(-1, num_heads, -1)), dim=-1)
    values = F.pad(kv[..., nope:], (0, qk_dim - v_dim)) if v_dim < qk_dim else kv[..., nope:]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         is_causal=True, scale=scale)
    return out.transpose(0, 1)[..., :v_dim]


def _expanded(q: torch.Tensor, ctx: torch.Tensor, visible: torch.Tensor, kv_b_weight: torch.Tensor, scale: float,
              lora: int, nope: int, v_dim: int) -> torch.Tensor:
    """One request's queries [n, H, nope + R] over its context rows [S, L + R]: keys and values expanded per head
    (as HF transformers computes them); [n, H, v]."""
    num_heads = q.shape[1]
    kv = F.linear(ctx[:, :lora], kv_b_weight).view(ctx.shape[0], num_heads, nope + v_dim)
    k_pe = ctx[:, None, lora:].expand(-1, num_heads, -1)
    keys = torch.cat((kv[..., :nope], k_pe), dim=-1)
    values = kv[..., nope:]
    causal = visible.shape[0] == visible.shape[1]  # nothing cached before: plain causal attention
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=None if causal else visible, is_causal=causal, scale=scale)
    return out.transpose(0, 1)


def _absorbed(q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None, w_uk: torch.Tensor,
              w_uv: torch.Tensor, scale: float, lora: int) -> torch.Tensor:
    """Queries [R, H, nope + R] each over its own context rows [R, S, L + R] (mask [R, 1, S] or [R, S] additive):
    W_UK absorbed into the queries, W_UV into the output; [R, H, v]."""
    nope = w_uk.shape[1]
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)  # [R, H, L]
    scores = torch.bmm(torch.cat((q_lat, q[..., nope:]), dim=-1), ctx.transpose(1, 2)).mul_(scale)  # [R, H, S]
    if mask is not None:
        scores = scores + (mask if mask.dim() == 3 else mask[:, None, :])
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    o_lat = torch.bmm(probs, ctx[..., :lora])  # [R, H, L]
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [R, H, v]


def _decode_plan(meta: AttentionMetadata, rows: list[int], block_size: int) -> MLADecodePlan:
    """Built by a step's first MLA layer, reused by the others (the torch backend's metadata keeps it)."""
    plans = getattr(meta, "plans", None)
    if plans is not None and "mla" in plans:
        return plans["mla"]
    device = meta.block_table.device
    if len(rows) == meta.num_reqs:
        token_idx, seq_lens, tables = None, meta.seq_lens_t.long(), meta.block_table
    else:
        token_idx = torch.tensor([meta.query_start_loc[r] for r in rows], device=device)
        row_idx = torch.tensor(rows, device=device)
        seq_lens, tables = meta.seq_lens_t.long()[row_idx], meta.block_table[row_idx]
    length = max(meta.seq_lens[r] for r in rows)
    k_pos = torch.arange(length, device=device)
    slots = _slots_of(tables[:, :-(-length // block_size)].long(), k_pos, block_size)  # [R, Lmax]
    q_pos = (seq_lens - 1)[:, None]
    visible = k_pos[None, :] <= q_pos
    slots = torch.where(visible, slots, slots.gather(1, q_pos))  # hidden positions read the current token
    mask = None
    if any(meta.seq_lens[r] != length for r in rows):
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=device).masked_fill_(~visible, float("-inf"))
        mask = mask[:, None, :]
    plan = MLADecodePlan(token_idx, slots, mask)
    if plans is not None:
        plans["mla"] = plan
    return plan


def _slots_of(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of key positions [L] through block tables [..., n] (int64) -> [..., L]."""
    return tables.index_select(-1, positions // block_size) * block_size + positions % block_size
