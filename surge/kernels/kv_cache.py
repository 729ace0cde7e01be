"""Writes this step's keys and values into the paged KV cache at their slots (block_id * block_size + offset).

A negative slot means a padding token (a CUDA-graph batch padded to its capture size): nothing is written for it.
An FP8 cache (float8_e4m3fn) stores x / scale, saturated, with one float32 scale per tensor for keys and one for
values; the variant is a compile-time choice, so the plain write compiles as before.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from surge.kernels.reference import FP8_KV_DTYPE, FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def quantize_fp8(x, scale):
    """x / scale (IEEE division, as torch's), saturated to +-448, rounded to float8e4nv: reference.quantize_fp8."""
    return tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -_FP8_MAX, _FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                     DIM_PAD: tl.constexpr, CACHE_BLOCK: tl.constexpr, FP8: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    head = tl.arange(0, HEADS_PAD)
    dim = tl.arange(0, DIM_PAD)
    mask = (head < NUM_KV_HEADS)[:, None] & (dim < HEAD_DIM)[None, :]
    dst = ((slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_cs
           + head[:, None] * stride_ch + dim[None, :])
    k = tl.load(k_ptr + token * stride_kt + head[:, None] * stride_kh + dim[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head[:, None] * stride_vh + dim[None, :], mask=mask)
    if FP8:
        k = quantize_fp8(k, tl.load(k_scale_ptr))
        v = quantize_fp8(v, tl.load(v_scale_ptr))
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D] (any token/head strides, unit stride on D); k_cache, v_cache: [num_blocks, block_size, Hkv,
    D] with the same strides; slot_mapping: [T] integer, negative for tokens to skip. An FP8 cache needs k_scale and
    v_scale: float32 scalar tensors on the device."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert tuple(k_cache.stride()) == tuple(v_cache.stride()), "K and V caches must share a layout"
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    assert not fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs k_scale and v_scale"
    elements = triton.next_power_of_2(num_kv_heads) * triton.next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim), CACHE_BLOCK=k_cache.shape[1], FP8=fp8,
        num_warps=min(8, max(1, elements // 256)))
