"""Rotary position embedding in Triton, HF "rotate half" layout, in place on q and k: one program per token looks up
cos/sin for its position once and rotates every query and key head with them.
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
