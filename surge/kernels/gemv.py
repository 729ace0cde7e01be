"""Decode's GEMM of fp8 weights: y [M, N] = x [M, K] @ dequantized(W).T for a few rows (M <= MAX_ROWS), activations
left in their dtype (weight-only, as fp8 Marlin runs where no fp8 MMA is used). At batch 1 a linear layer is a
matrix-vector product that only streams its weight: torch._scaled_mm pads M to a tensor-core tile and needs the
activations quantized first (one more launch per layer); this kernel reads each weight byte once and multiplies in
registers.

Scales: per output row (`weight_scale` [N, 1], per-tensor and per-channel checkpoints) applied once per row at the
end, or per 128 x 128 block ([ceil(N / 128), ceil(K / 128)], DeepSeek / Qwen3-FP8) applied per K tile.

Launch policy (launch_policy): one program per BLOCK_N = 8 output rows (many programs resident per SM, so that
enough bytes are in flight to cover the memory latency), the whole K streamed in steps of BLOCK_K = 1024 / M_PAD
columns, at least 128. Measured on the H200 at M = 1 over Qwen3-8B's layers (bench kernels --only gemv): 8 x 512
read 1.4-1.8 TB/s, 8 x 1024 2.0-2.6 TB/s (16 x 1024 for q/k/v 2.3), bf16 cuBLAS 3.2-4.0 TB/s of its twice larger
weight: the fp8 GEMV takes 77-79% of bf16's time. (A packed-int4 GEMV of the same shape read ~0.4 TB/s, no better
than int4_gemm.int_gemm's split-K tiles at 0.38-0.53 TB/s, and was dropped: unpacking, not memory, bounds both;
surge/kernels/int_gemv.py unpacks with one LOP3 and one FADD a value instead.) Each step loads a
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
    split_k: int = 1  # > 1: partial sums added into a zeroed float32 output (atomics), cast afterwards
    num_stages: int = 1  # loads of later K steps issued ahead (Triton's software pipelining)
    reduce_once: bool = False  # accumulate products elementwise, reduce over K once at the end


def launch_policy(m: int, n: int, k: int) -> GemvLaunch:
    m_pad = max(1, triton.next_power_of_2(m))
    return GemvLaunch(8, min(max(SCALE_BLOCK, 1024 // m_pad), max(16, triton.next_power_of_2(k))), num_warps=4)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                     stride_om, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr, REDUCE_ONCE: tl.constexpr):
    """out[m, n] (+)= sum over this split's K of x[m, k] * W[n, k] * scale (+ bias[n] once), float32 accumulation."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    pid_k = tl.program_id(1)
    k_len = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_len
    k_end = tl.minimum(K, k_begin + k_len)
    if REDUCE_ONCE:
        acc3 = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + ks
        k_ok = k < K
        w = tl.load(w_ptr + cols64[:, None] * stride_wn + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0, eviction_policy="evict_first").to(tl.float32)
        if BLOCK_SCALES:  # BLOCK_N rows lie in one 128-row block; the tile's columns in one or more blocks
            s = tl.load(scale_ptr + (cols64 // 128)[:, None] * stride_sn + (k // 128)[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            w = w * s
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        if REDUCE_ONCE:
            acc3 += x[:, None, :] * w[None, :, :]
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if REDUCE_ONCE:
        acc = tl.sum(acc3, axis=2)
    if not BLOCK_SCALES:
        acc = acc * tl.load(scale_ptr + cols64 * stride_sn, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_fp8_weight(weight: torch.Tensor, weight_scale: torch.Tensor, k: int, block_scales: bool) -> None:
    """An fp8 weight [N, K] with unit stride on K and its float32 scales ([N, 1] per row, or [ceil(N / 128),
    ceil(K / 128)] blocks), or a ValueError naming what does not fit (this GEMV's and fp8_wo_gemm's)."""
    n = weight.shape[0]
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (n, k) or weight.stride(1) != 1:
        raise ValueError(f"weight must be float8_e4m3fn [N, K={k}] with unit stride on K, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    expected = (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK)) if block_scales else (n, 1)
    if tuple(weight_scale.shape) != expected or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 {expected}, got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
             block_scales: bool = False, launch: GemvLaunch | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; bf16, fp16 or fp32), weight float8_e4m3fn [N, K], weight_scale float32 [N, 1] or,
    block_scales, [ceil(N / 128), ceil(K / 128)] -> [M, N] in x's dtype: x @ dequantized(W).T (+ bias)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"fp8_gemv takes up to {MAX_ROWS} rows, got {m}")
    check_fp8_weight(weight, weight_scale, k, block_scales)
    if x.stride(1) != 1:
        x = x.contiguous()
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    launch = launch or launch_policy(m, n, k)
    split = launch.split_k > 1
    out = (torch.zeros if split else torch.empty)(m, n, dtype=torch.float32 if split else x.dtype, device=x.device)
    weight_scale = weight_scale.contiguous()
    _fp8_gemv_kernel[(triton.cdiv(n, launch.block_n), launch.split_k)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k, x.stride(0),
        weight.stride(0), weight_scale.stride(0), out.stride(0), M_PAD=max(1, triton.next_power_of_2(m)),
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, BLOCK_SCALES=block_scales, HAS_BIAS=bias is not None,
        SPLIT_K=launch.split_k, NUM_STAGES=launch.num_stages, REDUCE_ONCE=launch.reduce_once,
        num_warps=launch.num_warps)
    return out.to(x.dtype) if split else out
