"""GEMM of fp8 weights against a few rows of bf16/fp16 activations, on tensor cores: y [M, N] = x [M, K] @
dequantized(W).T for the decode batches between the GEMV's rows (gemv.py, M <= 4) and the sizes where
torch._scaled_mm's tiles fill (a few hundred rows).

At M = 64 cuBLASLt's fp8 GEMM (torch._scaled_mm) runs one 128 x 128 tile shape and reads Qwen3-8B's weights at
1.2-2.4 TB/s, barely faster than bf16 cuBLAS reading twice the bytes (H200, bench kernels --only quant). A decode
step is the weight's bandwidth, so this kernel swaps the operands: the weight tile [BLOCK_N, BLOCK_K] is the MMA's
M side (64 or 128 rows, what Hopper's tensor cores take), the step's rows the narrow N side (BLOCK_T >= 16), and
the weight is converted fp8 -> activation dtype in registers (weight-only, W8A16: no activation quantization launch,
as fp8 Marlin runs). Scales: per output row (`weight_scale` [N, 1]) once at the end, or 128 x 128 blocks
([ceil(N / 128), ceil(K / 128)]) per K tile, which then lies in one block (BLOCK_K <= 128, BLOCK_N divides 128).

Split-K (SPLIT_K > 1) for layers with few output tiles (o_proj, down_proj: 4096 rows = 32-64 tiles on 132 SMs):
each split adds its float32 partial into a zeroed float32 output with atomics, cast afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.gemv import SCALE_BLOCK, check_fp8_weight

MAX_ROWS = 128  # the widest BLOCK_T; beyond it, torch._scaled_mm


@dataclass(frozen=True)
class WoLaunch:
    block_t: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def launch_policy(m: int, n: int, k: int, num_sms: int = 132, block_scales: bool = False) -> WoLaunch:
    """BLOCK_T: the rows rounded up to a power of two, at least 16 (the MMA's narrow side). BLOCK_N 64 rows of the
    weight a program; split K until there are about two programs per SM, each keeping >= 8 K steps of 128 (so
    the partial sums' atomics stay a small share of the traffic)."""
    block_t = max(16, triton.next_power_of_2(m))
    block_n, block_k = 64, 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_t)
    steps = triton.cdiv(k, block_k)
    split_k = 1
    while tiles * split_k < 2 * num_sms and steps // (split_k * 2) >= 8:
        split_k *= 2
    return WoLaunch(block_t, block_n, block_k, split_k)


@triton.jit
def _fp8_wo_gemm_kernel(x_ptr, x_scale_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                        stride_sn, stride_om, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
                        PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, X_FP8: tl.constexpr):
    """out[t, n] (+)= sum over this split's K of W[n, k] * x[t, k] * scale (+ bias[n] once). X_FP8: x is fp8 with
    per-row scales (x_scale [M, 1]) and the MMA takes both operands as fp8."""
    pid_n, pid_t, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    ns64 = ns.to(tl.int64)
    ts = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = ts < M
    ks = tl.arange(0, BLOCK_K)
    k_len = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_len
    k_end = tl.minimum(K, k_begin + k_len)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + ks
        k_ok = k < K
        xt = tl.load(x_ptr + ts[None, :] * stride_xm + k[:, None], mask=k_ok[:, None] & t_ok[None, :], other=0.0)
        w = tl.load(w_ptr + ns64[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if not X_FP8:
            w = w.to(xt.dtype)
        if BLOCK_SCALES:  # the tile lies in one 128 x 128 block: one scale per (row block, K tile)
            s = tl.load(scale_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK)
            acc += tl.dot(w, xt, input_precision=PRECISION) * s
        else:
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
    if not BLOCK_SCALES:
        acc = acc * tl.load(scale_ptr + ns64 * stride_sn, mask=n_ok, other=0.0)[:, None]
    if X_FP8:
        acc = acc * tl.load(x_scale_ptr + ts, mask=t_ok, other=0.0)[None, :]
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + ts[None, :] * stride_om + ns[:, None]
    mask = n_ok[:, None] & t_ok[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_wo_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                block_scales: bool = False, launch: WoLaunch | None = None, x_scale: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32), weight float8_e4m3fn [N, K], weight_scale float32 [N, 1] or, block_scales,
    [ceil(N / 128), ceil(K / 128)] -> [M, N] in x's dtype: x @ dequantized(W).T (+ bias). With x_scale (float32
    [M, 1]), x is float8_e4m3fn quantized per row (W8A8, fp8 MMA; per-row weight scales only) and out_dtype names
    the output's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    check_fp8_weight(weight, weight_scale, k, block_scales)
    if x.stride(1) != 1:
        x = x.contiguous()
    x_fp8 = x_scale is not None
    if x_fp8 and (x.dtype != torch.float8_e4m3fn or block_scales or tuple(x_scale.shape) != (m, 1)):
        raise ValueError(f"fp8 activations need float8_e4m3fn x, x_scale float32 [M, 1] and per-row weight scales, "
                         f"got {x.dtype}, {None if x_scale is None else tuple(x_scale.shape)}, "
                         f"block_scales={block_scales}")
    dtype = out_dtype or x.dtype
    if m == 0:
        return torch.empty(0, n, dtype=dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
    launch = launch or launch_policy(m, n, k, sms, block_scales)
    if block_scales and (launch.block_k > SCALE_BLOCK or SCALE_BLOCK % launch.block_n):
        raise ValueError(f"block scales need BLOCK_K <= 128 and BLOCK_N dividing 128, got {launch}")
    split = launch.split_k > 1
    out = (torch.zeros if split else torch.empty)(m, n, dtype=torch.float32 if split else dtype, device=x.device)
    weight_scale = weight_scale.contiguous()
    grid = (triton.cdiv(n, launch.block_n), triton.cdiv(m, launch.block_t), launch.split_k)
    _fp8_wo_gemm_kernel[grid](
        x, x_scale if x_fp8 else weight_scale, weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k, x.stride(0),
        weight.stride(0), weight_scale.stride(0), out.stride(0), BLOCK_T=launch.block_t, BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, SPLIT_K=launch.split_k, BLOCK_SCALES=block_scales, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", NUM_STAGES=launch.num_stages,
        X_FP8=x_fp8, num_warps=launch.num_warps)
    return out.to(dtype) if split else out
