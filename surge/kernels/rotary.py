"""Rotary position embedding in Triton, HF "rotate half" layout, in place on q and k: one program per token looks up
cos/sin for its position once and rotates every query and key head with them.

`rotary_write_kv` is the attention prologue in one launch instead of four: optional per-head RMSNorm of q and k
(Qwen3), rotary on both, q rotated in place, k and v written straight into the paged cache at their slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class RotaryLaunch:
    q_heads_pad: int
    k_heads_pad: int
    half_pad: int
    num_warps: int


def launch_policy(num_q_heads: int, num_k_heads: int, head_dim: int) -> RotaryLaunch:
    """All heads of one token in one tile: the most warps (a power of two, at most 8) that still give each at least
    1024 of the rotated elements."""
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for rotate-half rotary embedding")
    qp, kp, hp = (triton.next_power_of_2(n) for n in (num_q_heads, num_k_heads, head_dim // 2))
    elements = (qp + kp) * hp * 2
    num_warps = 1
    while num_warps < 8 and 2 * num_warps * 1024 <= elements:
        num_warps *= 2
    return RotaryLaunch(qp, kp, hp, num_warps)


@triton.jit
def _rotate_heads(base_ptr, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    head = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (head < NUM_HEADS)[:, None] & (i < HALF)[None, :]
    ptr = base_ptr + head[:, None] * stride_h + i[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(ptr, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(ptr + HALF, (b * cos + a * sin).to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cos, stride_sin, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                   Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos, sin, NUM_K_HEADS, K_HEADS_PAD, HALF, HALF_PAD)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor) -> None:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place (any token/head strides, unit stride on D, e.g. views of a
    fused qkv); positions [T] integer; cos_cache, sin_cache [max_position, D // 2] (RotaryEmbedding's buffers)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on tokens and head_dim")
    if cos_cache.shape[-1] != head_dim // 2 or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin caches {tuple(cos_cache.shape)}, {tuple(sin_cache.shape)} must be "
                         f"[max_position, {head_dim // 2}]")
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_cache.stride(-1) == 1 and sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    launch = launch_policy(num_q_heads, num_k_heads, head_dim)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_cache, sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_cache.stride(0), sin_cache.stride(0), NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads,
        Q_HEADS_PAD=launch.q_heads_pad, K_HEADS_PAD=launch.k_heads_pad, HALF=head_dim // 2,
        HALF_PAD=launch.half_pad, num_warps=launch.num_warps)


@triton.jit
def _norm_rotate(x1, x2, w_ptr, cos, sin, eps, HAS_NORM: tl.constexpr, HALF: tl.constexpr,
                 HALF_PAD: tl.constexpr):
    """x1, x2: the two halves of [heads, D] in their storage dtype. Per-head RMSNorm rounds as RMSNorm does
    (normalised value rounded to the dtype, then the weight product), so the result equals norm -> rotary."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        i = tl.arange(0, HALF_PAD)
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        rstd = 1.0 / tl.sqrt_rn((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
        a = ((a * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        b = ((b * rstd).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype).to(tl.float32)
    return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x2.dtype)


@triton.jit
def _rotary_write_kv_kernel(positions_ptr, slot_mapping_ptr, q_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
                            k_cache_ptr, v_cache_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                            stride_vh, stride_cos, stride_sin, stride_cb, stride_cs, stride_ch, eps,
                            NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                            K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                            HAS_NORM: tl.constexpr, CACHE_BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]

    if tl.program_id(1) == 0:  # the queries, in place
        qh = tl.arange(0, Q_HEADS_PAD)
        q_mask = (qh < NUM_Q_HEADS)[:, None] & (i < HALF)[None, :]
        q_ptrs = q_ptr + token * stride_qt + qh[:, None] * stride_qh + i[None, :]
        q1, q2 = _norm_rotate(tl.load(q_ptrs, mask=q_mask, other=0.0),
                              tl.load(q_ptrs + HALF, mask=q_mask, other=0.0), q_w_ptr, cos, sin, eps, HAS_NORM,
                              HALF, HALF_PAD)
        tl.store(q_ptrs, q1, mask=q_mask)
        tl.store(q_ptrs + HALF, q2, mask=q_mask)
    else:  # keys and values into the cache; a negative slot is a padding row of a CUDA graph
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            kh = tl.arange(0, K_HEADS_PAD)
            k_mask = (kh < NUM_K_HEADS)[:, None] & (i < HALF)[None, :]
            k_ptrs = k_ptr + token * stride_kt + kh[:, None] * stride_kh + i[None, :]
            k1, k2 = _norm_rotate(tl.load(k_ptrs, mask=k_mask, other=0.0),
                                  tl.load(k_ptrs + HALF, mask=k_mask, other=0.0), k_w_ptr, cos, sin, eps, HAS_NORM,
                                  HALF, HALF_PAD)
            dst = ((slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_cs + kh[:, None] * stride_ch
                   + i[None, :])
            tl.store(k_cache_ptr + dst, k1, mask=k_mask)
            tl.store(k_cache_ptr + dst + HALF, k2, mask=k_mask)
            v_ptrs = v_ptr + token * stride_vt + kh[:, None] * stride_vh + i[None, :]
            tl.store(v_cache_ptr + dst, tl.load(v_ptrs, mask=k_mask), mask=k_mask)
            tl.store(v_cache_ptr + dst + HALF, tl.load(v_ptrs + HALF, mask=k_mask), mask=k_mask)


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_cache: torch.Tensor, sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                    k_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> None:
    """q [T, Hq, D] is normed (when weights are given) and rotated in place; k and v [T, Hk, D] go, k normed and
    rotated, into k_cache / v_cache [num_blocks, block_size, Hk, D] at slot_mapping [T] (negative: skipped); k
    itself is left as it was. Any token/head strides, unit stride on D."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if k.shape != (num_tokens, num_k_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree on tokens, "
                         "KV heads and head_dim")
    if cos_cache.shape[-1] != head_dim // 2 or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin caches {tuple(cos_cache.shape)}, {tuple(sin_cache.shape)} must be "
                         f"[max_position, {head_dim // 2}]")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    assert all(t.stride(-1) == 1 for t in (q, k, v, cos_cache, sin_cache, k_cache))
    assert tuple(k_cache.stride()) == tuple(v_cache.stride()), "K and V caches must share a layout"
    if num_tokens == 0:
        return
    launch = launch_policy(num_q_heads, num_k_heads, head_dim)
    has_norm = q_norm_weight is not None
    _rotary_write_kv_kernel[(num_tokens, 2)](  # per token: one program for the queries, one for keys and values
        positions, slot_mapping, q, k, v, q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,
        cos_cache, sin_cache, k_cache, v_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), cos_cache.stride(0), sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), eps, NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, Q_HEADS_PAD=launch.q_heads_pad,
        K_HEADS_PAD=launch.k_heads_pad, HALF=head_dim // 2, HALF_PAD=launch.half_pad, HAS_NORM=has_norm,
        CACHE_BLOCK=k_cache.shape[1], num_warps=launch.num_warps)
