"""Decode's GEMMs of quantized weights: y [M, N] = x [M, K] @ dequantized(W).T for a few rows (M <= MAX_ROWS),
activations left in their dtype: fp8 weights (weight-only, as fp8 Marlin runs where no fp8 MMA is used), and int4 /
int8 weights in the canonical packed layout (surge/kernels/int4_gemm.py's, whose tensor-core tiles serve more rows). At batch 1 a linear layer is a
matrix-vector product that only streams its weight: torch._scaled_mm pads M to a tensor-core tile and needs the
activations quantized first (one more launch per layer); this kernel reads each weight byte once and multiplies in
registers.

Scales: per output row (`weight_scale` [N, 1], per-tensor and per-channel checkpoints) applied once per row at the
end, or per 128 x 128 block ([ceil(N / 128), ceil(K / 128)], DeepSeek / Qwen3-FP8) applied per K tile.

Launch policy (launch_policy): one program per BLOCK_N = 8 output rows (many programs resident per SM, so that
enough bytes are in flight to cover the memory latency), the whole K streamed in steps of BLOCK_K = 1024 / M_PAD
columns, at least 128. Measured on the H200 at M = 1 over Qwen3-8B's layers (bench kernels --only gemv): 8 x 512
read 1.4-1.8 TB/s, 8 x 1024 2.0-2.6 TB/s (16 x 1024 for q/k/v 2.3), bf16 cuBLAS 3.2-4.0 TB/s of its twice larger
weight: the fp8 GEMV takes 77-79% of bf16's time. The packed int GEMV reads ~0.4 TB/s (its unpacking, not memory,
bounds it): a kernel to rework. Each step loads a
[BLOCK_N, BLOCK_K] fp8 tile (BLOCK_K bytes contiguous per row), its block scales where they apply, and the
[M_PAD, BLOCK_K] activations, and reduces their product over K in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 4  # up to here the GEMM is the weight's bandwidth; beyond, torch._scaled_mm's tensor cores
SCALE_BLOCK = 128


@dataclass(frozen=True)
class GemvLaunch:
    block_n: int
    block_k: int
    num_warps: int


def launch_policy(m: int, n: int, k: int) -> GemvLaunch:
    m_pad = max(1, triton.next_power_of_2(m))
    return GemvLaunch(8, min(max(SCALE_BLOCK, 1024 // m_pad), max(16, triton.next_power_of_2(k))), num_warps=4)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                     stride_om, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[m, n] = sum_k x[m, k] * W[n, k] * scale (+ bias[n]), float32 accumulation."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        w = tl.load(w_ptr + cols64[:, None] * stride_wn + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        if BLOCK_SCALES:  # BLOCK_N rows lie in one 128-row block; the tile's columns in one or more blocks
            s = tl.load(scale_ptr + (cols64 // 128)[:, None] * stride_sn + (k // 128)[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            w = w * s
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if not BLOCK_SCALES:
        acc = acc * tl.load(scale_ptr + cols64 * stride_sn, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
             block_scales: bool = False, launch: GemvLaunch | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; bf16, fp16 or fp32), weight float8_e4m3fn [N, K], weight_scale float32 [N, 1] or,
    block_scales, [ceil(N / 128), ceil(K / 128)] -> [M, N] in x's dtype: x @ dequantized(W).T (+ bias)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"fp8_gemv takes up to {MAX_ROWS} rows, got {m}")
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (n, k) or weight.stride(1) != 1:
        raise ValueError(f"weight must be float8_e4m3fn [N, K={k}] with unit stride on K, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    expected = (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK)) if block_scales else (n, 1)
    if tuple(weight_scale.shape) != expected or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 {expected}, got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    launch = launch or launch_policy(m, n, k)
    weight_scale = weight_scale.contiguous()
    _fp8_gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k, x.stride(0),
        weight.stride(0), weight_scale.stride(0), out.stride(0), M_PAD=max(1, triton.next_power_of_2(m)),
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, BLOCK_SCALES=block_scales, HAS_BIAS=bias is not None,
        num_warps=launch.num_warps)
    return out


@triton.jit
def _int_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                     stride_sn, stride_zn, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                     HAS_ZERO: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    """out[m, n] = sum_k x[m, k] * (u[n, k] - z[n, k // GROUP]) * s[n, k // GROUP] (+ bias[n])."""
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    word_ids = tl.arange(0, WORDS)
    shifts = tl.arange(0, PER_WORD) * BITS
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        word = k0 // PER_WORD + word_ids
        words = tl.load(w_ptr + cols64[:, None] * stride_wn + word[None, :],
                        mask=col_ok[:, None] & (word < K // PER_WORD)[None, :], other=0)
        u = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), (BLOCK_N, BLOCK_K))
        group = k // GROUP
        s = tl.load(scale_ptr + cols64[:, None] * stride_sn + group[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(zero_ptr + cols64[:, None] * stride_zn + group[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0).to(tl.int32)
        else:
            z = 1 << (BITS - 1)
        w = (u - z).to(tl.float32) * s
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def int_gemv(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, *, bits: int,
             group_size: int, zero_point: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             launch: GemvLaunch | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), the canonical packed weight (int4_gemm.int_gemm's arguments, without act-order)
    -> [M, N] in x's dtype. The weight is dequantized in float32 (the tensor-core GEMM rounds it to x's dtype first:
    the two agree to that rounding)."""
    m, k = x.shape
    n = weight_packed.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"int_gemv takes up to {MAX_ROWS} rows, got {m}")
    if bits not in (4, 8) or weight_packed.dtype != torch.int32 or tuple(weight_packed.shape) != (n, k * bits // 32):
        raise ValueError(f"weight_packed {weight_packed.dtype} {tuple(weight_packed.shape)} does not hold [N, K={k}] "
                         f"{bits}-bit values packed along K in int32")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    launch = launch or launch_policy(m, n, k)
    weight_scale = weight_scale.contiguous()
    zero = zero_point.contiguous() if zero_point is not None else weight_scale
    _int_gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        x, weight_packed.contiguous(), weight_scale, zero, bias if bias is not None else weight_scale, out, m, n, k,
        x.stride(0), weight_packed.stride(0), weight_scale.stride(0), zero.stride(0), out.stride(0), BITS=bits,
        GROUP=min(group_size, k), HAS_ZERO=zero_point is not None, M_PAD=max(1, triton.next_power_of_2(m)),
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, HAS_BIAS=bias is not None,
        num_warps=launch.num_warps)
    return out
