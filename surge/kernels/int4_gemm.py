"""Weight-only int4/int8 GEMM in Triton (W4A16, W8A16): y = x @ W.T with W dequantized in registers from the
canonical packed layout of surge/kernels/int_packing.py, tl.dot in the activation dtype, float32 accumulation.

Layout: weight_packed int32 [N, K * bits / 32] (packed along K, low bits first), weight_scale [N, K / group], optional
zero_point uint8 [N, K / group] (unsigned; None is symmetric, 2^(bits-1)), optional input_perm int32 [K] (GPTQ
act-order: x's columns gathered in the K loop). Groups of 32, 64, 128 ... or channel-wise (group = K). Each K step
loads a [BLOCK_N, BLOCK_K * bits / 32] tile of words (contiguous along K: vector loads, each byte once), unpacks it by
shifts into [BLOCK_N, BLOCK_K], subtracts the zero and multiplies by the scale (one per column: every tile lies in one
group), rounded to x's dtype: exactly quant_reference.dequantize_packed's weight, fed transposed to tl.dot.

Launch policy (launch_policy): up to SPLIT_K_MAX_M rows (decode: memory-bound, few output tiles) split K across
programs so that about two waves of programs stream the weight, each writing a float32 partial that one more launch
sums in order (deterministic) with the bias; more rows (prefill) take square tiles without split.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

SPLIT_K_MAX_M = 32  # rows up to which the GEMM is memory-bound enough to split K
MAX_SPLIT_K = 16
H200_SMS = 132


@dataclass(frozen=True)
class IntGemmLaunch:
    block_m: int
    block_n: int
    block_k: int  # divides group_size (or group_size >= K): one scale per column per tile
    split_k: int  # programs along K; 1: no split, no partials
    num_warps: int
    num_stages: int


def launch_policy(m: int, n: int, k: int, group_size: int, num_sms: int = H200_SMS) -> IntGemmLaunch:
    """Pure function of the shapes (m: a CUDA graph's capture size under graphs). block_k is the largest power of two
    up to 128 (decode) or 64 (prefill) that divides the group (channel-wise: any, the last tile masked). Decode:
    16..32-row tiles of 64 columns, K split in powers of two until about 2 * num_sms programs, each split keeping at
    least 4 K tiles. Prefill: 64 x 128 tiles (128 x 128 beyond 128 rows)."""
    for name, value in (("m", m), ("n", n), ("k", k), ("group_size", group_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    decode = m <= SPLIT_K_MAX_M
    block_k = min(128 if decode else 64, max(16, triton.next_power_of_2(k)))
    if group_size < k:
        block_k = min(block_k, group_size & -group_size)  # the largest power of two dividing the group
    if block_k < 16:
        raise ValueError(f"group_size={group_size} must be a multiple of 16 (tl.dot's smallest K tile)")
    if decode:
        block_m, block_n = max(16, triton.next_power_of_2(m)), min(64, max(16, triton.next_power_of_2(n)))
        tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        split = 1
        while split < MAX_SPLIT_K and tiles * split < 2 * num_sms and k_tiles >= 8 * split:
            split *= 2
        return IntGemmLaunch(block_m, block_n, block_k, split, num_warps=4, num_stages=4)
    block_m = 64 if m <= 128 else 128
    return IntGemmLaunch(block_m, min(128, max(16, triton.next_power_of_2(n))), block_k, 1,
                         num_warps=4 if block_m == 64 else 8, num_stages=3)


@cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H200_SMS


@triton.jit
def _int_gemm_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, perm_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
                     stride_xm, stride_wn, stride_sn, stride_zn, stride_om, stride_split,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """out[split, m, n] = sum over this split's k of x[m, perm[k]] * W[n, k] (+ bias[n], unsplit only)."""
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    word_ids = tl.arange(0, WORDS)
    shifts = tl.arange(0, PER_WORD) * BITS
    k_begin = split * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + ks
        k_ok = k < k_end
        src = tl.load(perm_ptr + k, mask=k_ok, other=0) if HAS_PERM else k
        a = tl.load(x_ptr + rows64[:, None] * stride_xm + src[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        # The words of the tile, contiguous along K (K % PER_WORD == 0, so a word is wholly in or out), unpacked to
        # [BLOCK_N, BLOCK_K]: value k of the tile is bits (k % PER_WORD) * BITS of word k // PER_WORD.
        word = k0 // PER_WORD + word_ids
        words = tl.load(w_ptr + cols64[:, None] * stride_wn + word[None, :],
                        mask=col_ok[:, None] & (word < k_end // PER_WORD)[None, :], other=0)
        u = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), (BLOCK_N, BLOCK_K))
        group = k0 // GROUP
        scale = tl.load(scale_ptr + cols64 * stride_sn + group, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(zero_ptr + cols64 * stride_zn + group, mask=col_ok, other=0).to(tl.int32)[:, None]
        else:
            zero = 1 << (BITS - 1)
        w = ((u - zero).to(tl.float32) * scale[:, None]).to(x_ptr.dtype.element_ty)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + split * stride_split + rows64[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(partial_ptr, bias_ptr, out_ptr, numel, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out = sum over splits of partial[split] (+ bias), in split order, rounded once to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + split * numel + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_int_operands(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, bits: int,
                       group_size: int, zero_point: torch.Tensor | None, kernel: str) -> tuple[int, int]:
    """(K, N) of an int GEMM's operands in the canonical layout, or a ValueError naming what does not fit (shared by
    int_gemm and int_gemv.int_gemv, `kernel` naming which)."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported: the {kernel} reads 4- or 8-bit weights")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x of dtype {x.dtype}: the {kernel} takes bf16, fp16 or fp32 activations")
    k = x.shape[-1]
    n = weight_packed.shape[0]
    groups = triton.cdiv(k, group_size)
    if weight_packed.dtype != torch.int32 or tuple(weight_packed.shape) != (n, k * bits // 32) or k * bits % 32:
        raise ValueError(f"weight_packed {weight_packed.dtype} {tuple(weight_packed.shape)} does not hold [N, K = {k}] "
                         f"{bits}-bit values packed along K in int32")
    if (group_size < k and k % group_size) or tuple(weight_scale.shape) != (n, groups):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} with group_size={group_size} does not fit K={k}: "
                         f"expected [{n}, {groups}] and K a multiple of the group")
    if zero_point is not None and tuple(zero_point.shape) != (n, groups):
        raise ValueError(f"zero_point {tuple(zero_point.shape)}, expected [{n}, {groups}] (unpacked, uint8)")
    return k, n


def int_gemm(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, *, bits: int,
             group_size: int, zero_point: torch.Tensor | None = None, input_perm: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, launch: IntGemmLaunch | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T (+ bias [N]) in x's dtype (bf16, fp16 or fp32), W in the canonical layout above
    (quant_reference.int_gemm is the definition). group_size: 32, 64, 128 ... (K a multiple of it) or K
    (channel-wise; K a multiple of 32 / bits)."""
    k, n = check_int_operands(x, weight_packed, weight_scale, bits, group_size, zero_point, "int GEMM")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    if launch is None:
        launch = launch_policy(m, n, k, group_size, _num_sms(x.device))
    k_tiles = triton.cdiv(k, launch.block_k)
    k_per_split = triton.cdiv(k_tiles, launch.split_k) * launch.block_k
    split_k = triton.cdiv(k, k_per_split)  # every split non-empty
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    weight_packed, weight_scale = weight_packed.contiguous(), weight_scale.contiguous()
    zero = zero_point.contiguous() if zero_point is not None else weight_scale  # never read without zeros
    perm = input_perm.contiguous() if input_perm is not None else weight_packed
    bias_arg = bias.contiguous() if bias is not None else weight_scale
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), split_k)
    _int_gemm_kernel[grid](
        x2, weight_packed, weight_scale, zero, perm, bias_arg, target, m, n, k, k_per_split,
        x2.stride(0), weight_packed.stride(0), weight_scale.stride(0), zero.stride(0), n, m * n,
        BITS=bits, GROUP=min(group_size, k), HAS_ZERO=zero_point is not None, HAS_PERM=input_perm is not None,
        HAS_BIAS=bias is not None and split_k == 1, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, bias_arg, out, m * n, n, SPLIT_K=split_k,
                                                         HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out.view(*lead, n)
