"""Rotary position embedding in Triton, in place on q and k: one program per token looks up cos/sin for its position
once and rotates every query and key head with them. The first rotary_dim channels of a head turn (all of them by
default), the rest pass through; in HF's "rotate half" (NeoX) layout, or GPT-J's interleaved one (pairs 2i, 2i + 1).

`rotary_write_kv` is the attention prologue in one launch instead of four: optional per-head RMSNorm of q and k
(Qwen3), rotary on both, q rotated in place, k and v written straight into the paged cache at their slots (an FP8
cache's quantized as kv_cache.write_kv_cache does, a compile-time variant).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.kv_cache import quantize_fp8
from surge.kernels.reference import FP8_KV_DTYPE


@dataclass(frozen=True)
class RotaryLaunch:
    q_heads_pad: int
    k_heads_pad: int
    half_pad: int  # rotated pairs per head, padded
    num_warps: int
    rest_pad: int = 0  # channels past rotary_dim (partial rotary), padded; 0: the whole head turns


def launch_policy(num_q_heads: int, num_k_heads: int, head_dim: int, rotary_dim: int | None = None) -> RotaryLaunch:
    """All heads of one token in one tile: the most warps (a power of two, at most 8) that still give each at least
    1024 of the elements touched. rotary_dim: the channels that turn (None: head_dim)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in (0, head_dim={head_dim}]")
    qp, kp, hp = (triton.next_power_of_2(n) for n in (num_q_heads, num_k_heads, rotary_dim // 2))
    rest_pad = triton.next_power_of_2(head_dim - rotary_dim) if head_dim > rotary_dim else 0
    elements = (qp + kp) * (hp * 2 + rest_pad)
    num_warps = 1
    while num_warps < 8 and 2 * num_warps * 1024 <= elements:
        num_warps *= 2
    return RotaryLaunch(qp, kp, hp, num_warps, rest_pad)


@triton.jit
def _pair_offsets(HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Channels of the two members of each rotated pair i: i and i + HALF (NeoX), or 2i and 2i + 1 (GPT-J)."""
    i = tl.arange(0, HALF_PAD)
    if INTERLEAVED:
        return 2 * i, 2 * i + 1, i < HALF
    else:
        return i, i + HALF, i < HALF


@triton.jit
def _rotate_heads(base_ptr, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
    head = tl.arange(0, HEADS_PAD)
    off1, off2, pair_ok = _pair_offsets(HALF, HALF_PAD, INTERLEAVED)
    mask = (head < NUM_HEADS)[:, None] & pair_ok[None, :]
    ptr = base_ptr + head[:, None] * stride_h
    x1 = tl.load(ptr + off1[None, :], mask=mask, other=0.0)
    x2 = tl.load(ptr + off2[None, :], mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(ptr + off1[None, :], (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(ptr + off2[None, :], (b * cos + a * sin).to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cos, stride_sin, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                   Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    # Channels past 2 * HALF (partial rotary) are left where they are.
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD,
                  INTERLEAVED)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos, sin, NUM_K_HEADS, K_HEADS_PAD, HALF, HALF_PAD,
                  INTERLEAVED)


def _check_caches(head_dim: int, cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> int:
    """rotary_dim, from the caches' width: [max_position, rotary_dim // 2] each."""
    rotary_dim = 2 * cos_cache.shape[-1]
    if cos_cache.dim() != 2 or sin_cache.shape != cos_cache.shape or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"cos/sin caches {tuple(cos_cache.shape)}, {tuple(sin_cache.shape)} must both be "
                         f"[max_position, rotary_dim // 2] with 0 < rotary_dim <= head_dim={head_dim}")
    return rotary_dim


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor, interleaved: bool = False) -> None:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place (any token/head strides, unit stride on D, e.g. views of a
    fused qkv); positions [T] integer; cos_cache, sin_cache [max_position, rotary_dim // 2] (RotaryEmbedding's
    buffers): the first rotary_dim channels turn, the rest stay. interleaved: GPT-J's pairs (2i, 2i + 1)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on tokens and head_dim")
    rotary_dim = _check_caches(head_dim, cos_cache, sin_cache)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_cache.stride(-1) == 1 and sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    launch = launch_policy(num_q_heads, num_k_heads, rotary_dim)  # the rest is never touched
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_cache, sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_cache.stride(0), sin_cache.stride(0), NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads,
        Q_HEADS_PAD=launch.q_heads_pad, K_HEADS_PAD=launch.k_heads_pad, HALF=rotary_dim // 2,
        HALF_PAD=launch.half_pad, INTERLEAVED=interleaved, num_warps=launch.num_warps)


@triton.jit
def _store(ptr, x, mask, scale, FP8: tl.constexpr):
    """x (in the source's dtype) at ptr; into an FP8 cache quantized with scale."""
    if FP8:
        x = quantize_fp8(x, scale)
    tl.store(ptr, x, mask=mask)


@triton.jit
def _norm_rotate_heads(src_ptr, stride_h, dst_ptr, stride_dh, w_ptr, cos, sin, eps, scale, NUM_HEADS: tl.constexpr,
                       HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                       REST_PAD: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_NORM: tl.constexpr,
                       FP8: tl.constexpr):
    """[heads, D] from src to dst (the same place for q): per-head RMSNorm over all D channels, then the pairs of
    the first 2 * HALF rotated and the rest passed through. RMSNorm rounds as the layer does (normalised value
    rounded to the dtype, then the weight product), so the result equals norm -> rotary. FP8: dst is an FP8 cache;
    the result, rounded to the source's dtype, is quantized with scale (as the unfused path writes it)."""
    head = tl.arange(0, HEADS_PAD)
    head_ok = (head < NUM_HEADS)[:, None]
    off1, off2, pair_ok = _pair_offsets(HALF, HALF_PAD, INTERLEAVED)
    mask = head_ok & pair_ok[None, :]
    src = src_ptr + head[:, None] * stride_h
    dst = dst_ptr + head[:, None] * stride_dh
    x1 = tl.load(src + off1[None, :], mask=mask, other=0.0)
    x2 = tl.load(src + off2[None, :], mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if REST_PAD > 0:
        rest = 2 * HALF + tl.arange(0, REST_PAD)
        rest_mask = head_ok & (rest < HEAD_DIM)[None, :]
        x3 = tl.load(src + rest[None, :], mask=rest_mask, other=0.0)
    if HAS_NORM:
        squares = tl.sum(a * a, 1) + tl.sum(b * b, 1)
        if REST_PAD > 0:
            c = x3.to(tl.float32)
            squares += tl.sum(c * c, 1)
        rstd = 1.0 / tl.sqrt_rn(squares / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + off1, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + off2, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
        a = ((a * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        b = ((b * rstd).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype).to(tl.float32)
        if REST_PAD > 0:
            w3 = tl.load(w_ptr + rest, mask=rest < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
            x3 = ((c * rstd).to(x3.dtype).to(tl.float32) * w3).to(x3.dtype)
    _store(dst + off1[None, :], (a * cos - b * sin).to(x1.dtype), mask, scale, FP8)
    _store(dst + off2[None, :], (b * cos + a * sin).to(x2.dtype), mask, scale, FP8)
    if REST_PAD > 0:
        _store(dst + rest[None, :], x3, rest_mask, scale, FP8)


@triton.jit
def _rotary_write_kv_kernel(positions_ptr, slot_mapping_ptr, q_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
                            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_kt,
                            stride_kh, stride_vt, stride_vh, stride_cos, stride_sin, stride_cb, stride_cs, stride_ch,
                            eps, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                            K_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                            HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
                            HAS_NORM: tl.constexpr, CACHE_BLOCK: tl.constexpr, FP8: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]

    if tl.program_id(1) == 0:  # the queries, in place
        q_row = q_ptr + token * stride_qt
        _norm_rotate_heads(q_row, stride_qh, q_row, stride_qh, q_w_ptr, cos, sin, eps, 1.0, NUM_Q_HEADS,
                           Q_HEADS_PAD, HEAD_DIM, HALF, HALF_PAD, REST_PAD, INTERLEAVED, HAS_NORM, False)
    else:  # keys and values into the cache; a negative slot is a padding row of a CUDA graph
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            if FP8:
                k_scale = tl.load(k_scale_ptr)
                v_scale = tl.load(v_scale_ptr)
            else:
                k_scale = 1.0
                v_scale = 1.0
            dst = (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_cs
            _norm_rotate_heads(k_ptr + token * stride_kt, stride_kh, k_cache_ptr + dst, stride_ch, k_w_ptr, cos,
                               sin, eps, k_scale, NUM_K_HEADS, K_HEADS_PAD, HEAD_DIM, HALF, HALF_PAD, REST_PAD,
                               INTERLEAVED, HAS_NORM, FP8)
            # v as it is, in the same pieces (the pairs' channels and the rest cover the head once)
            kh = tl.arange(0, K_HEADS_PAD)
            off1, off2, pair_ok = _pair_offsets(HALF, HALF_PAD, INTERLEAVED)
            v_src = v_ptr + token * stride_vt + kh[:, None] * stride_vh
            v_dst = v_cache_ptr + dst + kh[:, None] * stride_ch
            mask = (kh < NUM_K_HEADS)[:, None] & pair_ok[None, :]
            _store(v_dst + off1[None, :], tl.load(v_src + off1[None, :], mask=mask), mask, v_scale, FP8)
            _store(v_dst + off2[None, :], tl.load(v_src + off2[None, :], mask=mask), mask, v_scale, FP8)
            if REST_PAD > 0:
                rest = 2 * HALF + tl.arange(0, REST_PAD)
                rest_mask = (kh < NUM_K_HEADS)[:, None] & (rest < HEAD_DIM)[None, :]
                _store(v_dst + rest[None, :], tl.load(v_src + rest[None, :], mask=rest_mask), rest_mask, v_scale,
                       FP8)


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_cache: torch.Tensor, sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                    k_norm_weight: torch.Tensor | None = None, eps: float = 0.0, interleaved: bool = False,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """q [T, Hq, D] is normed over the whole head (when weights are given) and rotated in place; k and v [T, Hk, D]
    go, k normed and rotated, into k_cache / v_cache [num_blocks, block_size, Hk, D] at slot_mapping [T] (negative:
    skipped); k itself is left as it was. Any token/head strides, unit stride on D. cos_cache, sin_cache
    [max_position, rotary_dim // 2]: the first rotary_dim channels turn, the rest pass through; interleaved: GPT-J's
    pairs (2i, 2i + 1). An FP8 cache needs k_scale and v_scale (float32 scalar tensors on the device)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if k.shape != (num_tokens, num_k_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree on tokens, "
                         "KV heads and head_dim")
    rotary_dim = _check_caches(head_dim, cos_cache, sin_cache)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    assert all(t.stride(-1) == 1 for t in (q, k, v, cos_cache, sin_cache, k_cache))
    assert tuple(k_cache.stride()) == tuple(v_cache.stride()), "K and V caches must share a layout"
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    assert not fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs k_scale and v_scale"
    if num_tokens == 0:
        return
    launch = launch_policy(num_q_heads, num_k_heads, head_dim, rotary_dim)
    has_norm = q_norm_weight is not None
    _rotary_write_kv_kernel[(num_tokens, 2)](  # per token: one program for the queries, one for keys and values
        positions, slot_mapping, q, k, v, q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,
        cos_cache, sin_cache, k_cache, v_cache, k_scale if fp8 else cos_cache, v_scale if fp8 else cos_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), cos_cache.stride(0), sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), eps, NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, Q_HEADS_PAD=launch.q_heads_pad,
        K_HEADS_PAD=launch.k_heads_pad, HEAD_DIM=head_dim, HALF=rotary_dim // 2, HALF_PAD=launch.half_pad,
        REST_PAD=launch.rest_pad, INTERLEAVED=interleaved, HAS_NORM=has_norm, CACHE_BLOCK=k_cache.shape[1],
        FP8=fp8, num_warps=launch.num_warps)
