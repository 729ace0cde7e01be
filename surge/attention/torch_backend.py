"""Paged attention in plain torch: the CPU path and the reference for the Triton backend.

Decode rows (one query each) gather their keys head-major ([row, KV head, position]), so each KV head's query heads
meet its keys in one batched matmul (no repeated KV); in float32 the probabilities then weight the value rows
straight from the cache (`embedding_bag`: a weighted sum of rows, no gathered copy of the values), which beats CPU
SDPA's flash kernel on the few-query problems decoding makes. Prefill rows run one request at a time. The rows to
read and the mask (none when every row sees every position) depend only on the step's metadata, so the first layer
of a KV group builds them and the group's other layers reuse them.
Only slots some request wrote are read: a position a query may not see is gathered from the row's own current
token (then masked), so the cache may start uninitialized (NaN or garbage never reaches a softmax).
An FP8 cache stores quantize_fp8(x) and reads dequantize the gathered rows (never the whole cache); this step's own
keys and values are used as stored, so every path sees what the Triton kernel reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from surge.attention.backend import (AttentionBackend, AttentionMetadata, AttentionParams, CommonAttentionMetadata,
                                    Prologue, register_backend)
from surge.kernels.reference import FP8_KV_DTYPE, dequantize_fp8, quantize_fp8


@dataclass
class DecodePlan:
    """The decode rows of one step, for one KV group and sliding window: what to gather, and the mask."""
    token_idx: torch.Tensor | None  # [R] token of each decode row; None: every row decodes, in order
    # [R * Hkv * L] row of the cache viewed as [slots * Hkv, head_dim] for each (row, KV head, key position): a
    # visible position's, or the row's current token's
    kv_rows: torch.Tensor
    value_rows: torch.Tensor  # [R * Hkv * group * L]: kv_rows repeated for each query head of a KV head (one bag each)
    value_offsets: torch.Tensor  # [R * Hkv * group] first entry of each bag
    mask: torch.Tensor | None  # [R, 1, 1, L] additive: 0 where visible, -inf elsewhere; None: all visible
    num_rows: int
    length: int  # L: the longest decode row's context


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    # sliding window -> plan, built on first use ("mla": surge/attention/mla.py's plan of the MLA layers)
    plans: dict[int | str | None, DecodePlan] = field(default_factory=dict)
    # (positions, cos table) -> the step's rotary factors [T, 1, D]: cos | cos and -sin | sin, built on first use
    rotary: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@register_backend
class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, common: CommonAttentionMetadata, slot_mapping: torch.Tensor,
                       block_table: torch.Tensor) -> AttentionMetadata:
        return TorchAttentionMetadata(**vars(common), slot_mapping=slot_mapping, block_table=block_table)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, params: AttentionParams, prologue=None,
                sinks=None, k_scale=None, v_scale=None):
        sliding_window, scale = params.sliding_window, params.scale
        if prologue is not None:
            q, k = _rotate(prologue, q, k, meta)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_slots = k_cache.view(-1, num_kv_heads * head_dim)  # one row per slot
        v_slots = v_cache.view(-1, num_kv_heads * head_dim)
        if k_cache.dtype == FP8_KV_DTYPE:
            k, v, scales = _write_fp8(k, v, k_slots, v_slots, meta.slot_mapping, k_scale, v_scale, q.dtype)
        else:
            k_slots.index_copy_(0, meta.slot_mapping, k.reshape(k.shape[0], -1))
            v_slots.index_copy_(0, meta.slot_mapping, v.reshape(v.shape[0], -1))
            scales = None
        cache = _Cache(k_slots, v_slots, scales, q.dtype)
        # A one-token row is causal either way: a chunk never ends inside an image, so its token ends any span.
        causal_end = meta.causal_end if params.bidirectional_spans else None
        if params.logit_softcap is not None or params.has_sinks:
            return _explicit(q, cache, meta, params, sinks, k_cache.shape[1], causal_end)

        qsl = meta.query_start_loc
        if meta.decode_only:
            return self._decode(q, cache, meta, sliding_window, scale, k_cache.shape[1])
        out = torch.empty_like(q)
        if any(qsl[r + 1] - qsl[r] == 1 for r in range(meta.num_reqs)):
            plan = self._plan(meta, sliding_window, k_cache.shape[1], num_kv_heads, q.shape[1] // num_kv_heads,
                              q.dtype)
            out[plan.token_idx] = self._decode(q, cache, meta, sliding_window, scale, k_cache.shape[1])
        block_size = k_cache.shape[1]
        fresh = _fresh_runs(meta, sliding_window) if causal_end is None else []
        for r, rows in fresh:  # nothing cached before: plain causal attention
            start, end = qsl[r], qsl[r + rows]
            shape = (rows, (end - start) // rows) + q.shape[1:]
            kv_shape = shape[:2] + k.shape[1:]
            out[start:end] = _sdpa(q[start:end].reshape(shape), k[start:end].reshape(kv_shape),
                                   v[start:end].reshape(kv_shape), None, scale).reshape(end - start, *q.shape[1:])
        for r in range(meta.num_reqs):
            start, end = qsl[r], qsl[r + 1]
            num_new = end - start
            seq_len = meta.seq_lens[r]
            if num_new == 1 or (seq_len == num_new and sliding_window is None and causal_end is None):  # done above
                continue
            # Keys from the first one the first query may see: a sliding window's older blocks may be gone.
            first = 0 if sliding_window is None else max(0, seq_len - num_new - sliding_window + 1)
            k_pos = torch.arange(first, seq_len, device=q.device)
            slots = _slots_of(meta.block_table[r].long(), k_pos, block_size)
            keys = cache.keys(slots).view(-1, num_kv_heads, head_dim)
            values = cache.values(slots).view(-1, num_kv_heads, head_dim)
            q_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
            mask = _visible(q_pos[:, None], k_pos[None, :], sliding_window,
                            None if causal_end is None else causal_end[start:end, None])
            out[start:end] = _sdpa(q[start:end].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                   mask, scale).squeeze(0)
        return out

    def _plan(self, meta: AttentionMetadata, sliding_window: int | None, block_size: int, num_kv_heads: int,
              group: int, dtype: torch.dtype) -> DecodePlan:
        plans = getattr(meta, "plans", None)
        plan = plans.get(sliding_window) if plans is not None else None
        if plan is None:
            plan = _decode_plan(meta, sliding_window, block_size, num_kv_heads, group, dtype)
            if plans is not None:
                plans[sliding_window] = plan
        return plan

    def _decode(self, q, cache: _Cache, meta, sliding_window, scale, block_size) -> torch.Tensor:
        """Every decode row's output [R, Hq, D], in row order."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = cache.k.shape[1] // head_dim
        group = num_heads // num_kv_heads
        plan = self._plan(meta, sliding_window, block_size, num_kv_heads, group, q.dtype)
        rows, length = plan.num_rows, plan.length
        head_rows = cache.per_head(head_dim)
        keys = head_rows.keys(plan.kv_rows).view(rows * num_kv_heads, length, head_dim)
        q_rows = q if plan.token_idx is None else q.index_select(0, plan.token_idx)
        # The query heads sharing a KV head are that head's queries: [R * Hkv, group, D], one mask row for all.
        grouped = q_rows.reshape(rows * num_kv_heads, group, head_dim)
        # The flash kernel accumulates half precision in float32; an FP8 cache's values must be dequantized anyway.
        if q.dtype != torch.float32 or cache.scales is not None:
            values = head_rows.values(plan.kv_rows).view(rows, num_kv_heads, length, head_dim)
            out = F.scaled_dot_product_attention(grouped.view(rows, num_kv_heads, group, head_dim),
                                                 keys.view(rows, num_kv_heads, length, head_dim), values,
                                                 attn_mask=plan.mask, scale=scale)
            return out.reshape(rows, num_heads, head_dim)
        scores = torch.bmm(grouped, keys.transpose(1, 2)).mul_(scale)
        if plan.mask is not None:
            scores.view(rows, num_kv_heads, group, length).add_(plan.mask)
        probs = scores.softmax(dim=-1)  # [R * Hkv, group, L]: one bag of L value rows per query head
        out = F.embedding_bag(plan.value_rows, head_rows.v, plan.value_offsets, mode="sum",
                              per_sample_weights=probs.view(-1))
        return out.view(rows, num_heads, head_dim)


@dataclass
class _Cache:
    """One layer's keys and values as rows (one per slot, or per slot and KV head); reads return the query's dtype,
    an FP8 cache's rows dequantized after the gather."""
    k: torch.Tensor
    v: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor] | None  # (k_scale, v_scale) of an FP8 cache
    dtype: torch.dtype

    def keys(self, rows: torch.Tensor) -> torch.Tensor:
        return self._read(self.k, rows, 0)

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        return self._read(self.v, rows, 1)

    def _read(self, cache: torch.Tensor, rows: torch.Tensor, which: int) -> torch.Tensor:
        gathered = cache.index_select(0, rows)
        return gathered if self.scales is None else dequantize_fp8(gathered, self.scales[which], self.dtype)

    def per_head(self, head_dim: int) -> _Cache:
        return _Cache(self.k.view(-1, head_dim), self.v.view(-1, head_dim), self.scales, self.dtype)


def _write_fp8(k, v, k_slots, v_slots, slot_mapping, k_scale, v_scale, dtype):
    """k and v quantized into an FP8 cache at their slots (as raw bytes: CPU index_copy_ has no float8 kernel);
    returns them as stored, dequantized to dtype, and the scales."""
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 KV cache needs k_scale and v_scale")
    stored = []
    for x, slots, scale in ((k, k_slots, k_scale), (v, v_slots, v_scale)):
        x8 = quantize_fp8(x, scale)
        slots.view(torch.uint8).index_copy_(0, slot_mapping, x8.reshape(x8.shape[0], -1).view(torch.uint8))
        stored.append(dequantize_fp8(x8, scale, dtype))
    return stored[0], stored[1], (k_scale, v_scale)


def _explicit(q, cache: _Cache, meta: AttentionMetadata, params: AttentionParams, sinks: torch.Tensor | None,
              block_size: int, causal_end: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with the variants SDPA has no argument for, one request at a time, scores computed in float32:
    logit soft-capping (s -> cap * tanh(s / cap), before the mask) and sinks (a per-head logit in each softmax's
    denominator, weighting no value), as HF's eager attention does."""
    num_kv_heads, head_dim = cache.k.shape[1] // q.shape[2], q.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    qsl = meta.query_start_loc
    for r in range(meta.num_reqs):
        start, end = qsl[r], qsl[r + 1]
        if start == end:
            continue
        seq_len = meta.seq_lens[r]
        window = params.sliding_window
        first = 0 if window is None else max(0, seq_len - (end - start) - window + 1)
        k_pos = torch.arange(first, seq_len, device=q.device)
        slots = _slots_of(meta.block_table[r].long(), k_pos, block_size)
        keys = cache.keys(slots).view(-1, num_kv_heads, head_dim).float()
        values = cache.values(slots).view(-1, num_kv_heads, head_dim).float()
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * params.scale
        if params.logit_softcap is not None:
            scores = torch.tanh(scores / params.logit_softcap) * params.logit_softcap
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        q_end = None if causal_end is None else causal_end[start:end, None]
        scores = scores.masked_fill(~_visible(q_pos[:, None], k_pos[None, :], window, q_end), float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, end - start, 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def _rotate(prologue: Prologue, q: torch.Tensor, k: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """`prologue.apply` in float32 without a q/k norm, bitwise: x * (cos | cos) + (x2 | x1) * (-sin | sin) is the
    reference's x1 cos - x2 sin | x2 cos + x1 sin (a negated factor and a + (-b) round exactly as a - b). The factors
    are looked up once per step; q and k are one view when k's heads follow q's in memory (the merged projection's
    output), else one cat. Four elementwise ops a layer instead of about twelve (decode: 46 -> 19 us a layer)."""
    if q.dtype != torch.float32 or prologue.q_norm_weight is not None or prologue.interleaved or \
            prologue.rotary_dim != q.shape[-1]:
        return prologue.apply(q, k)
    num_q_heads = q.shape[1]
    tables = getattr(meta, "rotary", None)
    key = (prologue.positions.data_ptr(), prologue.positions.shape[0], prologue.cos_cache.data_ptr())
    factors = tables.get(key) if tables is not None else None
    if factors is None:
        cos, sin = prologue.cos_cache[prologue.positions], prologue.sin_cache[prologue.positions]
        factors = (torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1))
        if tables is not None:
            tables[key] = factors
    cos2, sin2 = factors
    qk = _heads_side_by_side(q, k)
    x1, x2 = qk.chunk(2, dim=-1)
    out = torch.cat((x2, x1), dim=-1).mul_(sin2).add_(qk * cos2)  # b + a: addition commutes, bitwise
    return out[:, :num_q_heads], out[:, num_q_heads:]


def _heads_side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[T, Hq + Hk, D]: a view when k's heads follow q's in each row of one buffer, else a copy."""
    t, hq, d = q.shape
    adjacent = (k.shape[0] == t and k.shape[2] == d and q.stride(0) >= (hq + k.shape[1]) * d
                and q.stride() == (q.stride(0), d, 1)
                and k.stride() == (q.stride(0), d, 1) and k.dtype == q.dtype
                and k.data_ptr() == q.data_ptr() + hq * d * q.element_size()
                and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr())
    if adjacent:
        return torch.as_strided(q, (t, hq + k.shape[1], d), (q.stride(0), d, 1))
    return torch.cat((q, k), dim=1)


def _decode_plan(meta: AttentionMetadata, sliding_window: int | None, block_size: int, num_kv_heads: int,
                 group: int, dtype: torch.dtype) -> DecodePlan:
    qsl = meta.query_start_loc
    rows = [r for r in range(meta.num_reqs) if qsl[r + 1] - qsl[r] == 1]
    device = meta.block_table.device
    if len(rows) == meta.num_reqs:
        token_idx, seq_lens, tables = None, meta.seq_lens_t.long(), meta.block_table
    else:
        token_idx = torch.tensor([qsl[r] for r in rows], device=device)
        row_idx = torch.tensor(rows, device=device)
        seq_lens, tables = meta.seq_lens_t.long()[row_idx], meta.block_table[row_idx]
    length = max(meta.seq_lens[r] for r in rows)
    k_pos = torch.arange(length, device=device)
    slots = _slots_of(tables[:, :-(-length // block_size)].long(), k_pos, block_size)  # [R, L]
    q_pos = (seq_lens - 1)[:, None]
    visible = (k_pos[None, :] <= q_pos) & _visible(q_pos, k_pos[None, :], sliding_window)
    slots = torch.where(visible, slots, slots.gather(1, q_pos))  # hidden positions read the current token
    heads = torch.arange(num_kv_heads, device=device)
    kv_rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]  # [R, Hkv, L]
    num_rows = len(rows)
    # int32: half the index memory of int64 (R * Hq * L entries, as many as the scores); a cache of 2^31 rows of
    # head_dim values would be hundreds of GB
    value_rows = kv_rows[:, :, None, :].expand(num_rows, num_kv_heads, group, length).reshape(-1).int()
    value_offsets = torch.arange(0, value_rows.shape[0], length, dtype=torch.int32, device=device)
    mask = None  # equal lengths, no window cutting in: every position visible, nothing to add
    if any(meta.seq_lens[r] != length for r in rows) or (sliding_window is not None and length > sliding_window):
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        mask = mask[:, None, None, :]
    return DecodePlan(token_idx, kv_rows.reshape(-1), value_rows, value_offsets, mask, num_rows, length)


def _fresh_runs(meta: AttentionMetadata, sliding_window: int | None) -> list[tuple[int, int]]:
    """(first row, rows) of each run of consecutive prefill rows with nothing cached and the same length: one SDPA
    each, batched over its rows, as HF runs a padded batch (a step of equal prompts is one call per layer)."""
    if sliding_window is not None:
        return []
    qsl, runs = meta.query_start_loc, []
    for r in range(meta.num_reqs):
        num_new = qsl[r + 1] - qsl[r]
        if num_new == 1 or meta.seq_lens[r] != num_new:
            continue
        if runs and runs[-1][0] + runs[-1][1] == r and qsl[r] - qsl[r - 1] == num_new:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs


def _slots_of(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of key positions [L] through block tables [..., n] (int64) -> [..., L]."""
    return tables.index_select(-1, positions // block_size) * block_size + positions % block_size


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None,
             q_end: torch.Tensor | None = None) -> torch.Tensor:
    """Keys a query sees: up to itself, or up to q_end where that is later (the rest of its image span), and with
    a sliding window none sliding_window or more positions before it (HF's AND(window, OR(causal, image)))."""
    visible = k_pos <= (q_pos if q_end is None else torch.maximum(q_pos, q_end.long()))
    if sliding_window is not None:
        visible = visible & (k_pos > q_pos - sliding_window)
    return visible


def _sdpa(q, k, v, mask, scale):
    """q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D]; mask: [Tq, Tk] bool, or None for causal with Tq == Tk.
    Returns [B, Tq, Hq, D]."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask is not None:
        mask = mask[None, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)
