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

The stream kernel (the default; SURGE_FP8_GEMV=tiles selects the one above): compiled for sm_90, the tiles kernel's
weight tile goes through shared memory every K step (its product is laid out one K value a thread, for the
per-step sum over K), with a barrier or two, which is where its 2.0-2.7 TB/s goes. The stream kernel keeps the
weight in its load layout: a step loads a [BLOCK_N, CHUNKS, 16] tile (16 contiguous bytes a thread, a warp's 32
threads reading 512 contiguous bytes of one row), multiplies it by the activations' [CHUNKS, 16] slice (one x
row at a time, each read once for the BLOCK_N / 4 rows a thread holds), sums the 16 products in the thread and
accumulates [BLOCK_N, CHUNKS] elementwise: the only cross-thread reduction is the one at the end. Triton's
software pipeline (num_stages, cp.async) keeps num_stages - 1 tiles of every program in flight without holding
them in registers, so the bytes in flight per SM are N * BLOCK_K * (num_stages - 1) / SMs (all programs resident
at once); stream_policy picks stages (and, for a small N, a K split) so that this reaches IN_FLIGHT_BYTES, the
bandwidth-latency product of HBM3e (4.8 TB/s x ~1.1 us / 132 SMs), and BLOCK_N so that the programs fit on the
SMs in one wave. The activations' slice of each step rides the same pipeline (they are read from L2/L1: K * 2
bytes a row shared by all programs).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from surge import envs

MAX_ROWS = 4  # up to here the GEMM is the weight's bandwidth; beyond, torch._scaled_mm's tensor cores
SCALE_BLOCK = 128
VEC = 16  # fp8 values a thread loads at once: 16 bytes
H200_SMS = 132
IN_FLIGHT_BYTES = 40 << 10  # weight bytes in flight per SM that cover HBM's latency at its bandwidth
MAX_SPLIT_K = 8


@dataclass(frozen=True)
class GemvLaunch:
    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 1  # > 1: partial sums added into a zeroed float32 output (atomics), cast afterwards
    num_stages: int = 1  # loads of later K steps issued ahead (Triton's software pipelining)
    reduce_once: bool = False  # accumulate products elementwise, reduce over K once at the end


@dataclass(frozen=True)
class StreamLaunch:
    """The stream kernel's launch: programs of block_n output rows x (K / split_k) columns, steps of chunks x 16
    columns, num_stages - 1 steps in flight (Triton's pipeline)."""
    block_n: int
    chunks: int
    num_stages: int = 3
    split_k: int = 1  # > 1: partial sums added into a zeroed float32 output (atomics), cast afterwards
    num_warps: int = 4

    @property
    def block_k(self) -> int:
        return self.chunks * VEC


def stream_policy(m: int, n: int, k: int, num_sms: int = H200_SMS) -> StreamLaunch:
    """Pure function of the shapes (m: a CUDA graph's capture size under graphs). Steps of 512 columns (32 chunks
    of 16: a warp reads 512 contiguous bytes of a row; fewer for a short K); 16 rows a program (4 a thread with 4
    warps, sharing each activation load; 56-96 registers at M = 1..4 for sm_90, so 5-9 programs an SM); stages 3,
    or 4 where N * BLOCK_K * 2 does not cover IN_FLIGHT_BYTES on every SM, and, only where N is too small for 4
    either, a K split. Qwen3-8B at M = 1..4: qkv (N 6144) 3 stages (47 KB in flight an SM), o and down (N 4096) 4
    stages (47 KB), gate_up (N 24576) 3 stages (all 1536 programs do not fit at once: ~1.3-2.3 waves, each with
    80-144 KB in flight an SM); none split."""
    for name, value in (("m", m), ("n", n), ("k", k), ("num_sms", num_sms)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if m > MAX_ROWS:
        raise ValueError(f"m={m}: the fp8 GEMV takes up to {MAX_ROWS} rows")
    chunks = min(32, triton.next_power_of_2(triton.cdiv(k, VEC)))
    block_k = chunks * VEC
    block_n = 16
    wanted = IN_FLIGHT_BYTES * num_sms
    stages = 3 if n * block_k * 2 >= wanted else 4
    steps = triton.cdiv(k, block_k)
    split = 1
    while split < MAX_SPLIT_K and n * block_k * (stages - 1) * split < wanted and steps >= 8 * split:  # 4 steps a split
        split *= 2
    return StreamLaunch(block_n, chunks, stages, split)


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


@triton.jit
def _fp8_stream_row(acc, x_ptr, row, stride_xm, k, k_ok, w, s, BLOCK_SCALES: tl.constexpr):
    """acc [BLOCK_N, CHUNKS] + this step's products of activation row `row` with w [BLOCK_N, CHUNKS, 16], summed
    over each thread's 16 columns (times the chunks' block scales s)."""
    x = tl.load(x_ptr + row * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
    dot = tl.sum(x[None, :, :] * w, axis=2)
    if BLOCK_SCALES:
        dot = dot * s
    return acc + dot


@triton.jit
def _fp8_stream_out(out_ptr, acc, row, n, n_ok, stride_om, M, s, bias, SPLIT_K: tl.constexpr,
                    BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):
    total = tl.sum(acc, axis=1)
    if not BLOCK_SCALES:
        total = total * s
    if HAS_BIAS:
        total += bias
    mask = n_ok & (row < M)
    if SPLIT_K > 1:
        tl.atomic_add(out_ptr + row * stride_om + n, total, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptr + row * stride_om + n, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_stream_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                       stride_sn, stride_om, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
                       BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    """out[m, n] (+)= sum over this split's K of x[m, k] * W[n, k] * scale (+ bias[n] once), float32 accumulation,
    for the M <= 4 rows of x (one accumulator each: a 4-D product would lose the weight's load layout)."""
    VEC_K: tl.constexpr = 16
    BLOCK_K: tl.constexpr = CHUNKS * VEC_K
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None, None] * stride_wn
    chunk_k = tl.arange(0, CHUNKS) * VEC_K
    kk = chunk_k[:, None] + tl.arange(0, VEC_K)[None, :]  # [CHUNKS, 16]
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc0 = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + kk
        k_ok = k < k_end
        w = tl.load(w_rows + k[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if BLOCK_SCALES:  # a chunk of 16 lies in one 128-column block; BLOCK_N rows may span two row blocks
            s = tl.load(scale_ptr + (n // 128).to(tl.int64)[:, None] * stride_sn + ((k0 + chunk_k) // 128)[None, :],
                        mask=n_ok[:, None] & (k0 + chunk_k < k_end)[None, :], other=0.0)
        else:
            s = 1.0
        acc0 = _fp8_stream_row(acc0, x_ptr, 0, stride_xm, k, k_ok, w, s, BLOCK_SCALES)
        if M_PAD > 1:
            acc1 = _fp8_stream_row(acc1, x_ptr, 1, stride_xm, k, k_ok & (1 < M), w, s, BLOCK_SCALES)
        if M_PAD > 2:
            acc2 = _fp8_stream_row(acc2, x_ptr, 2, stride_xm, k, k_ok & (2 < M), w, s, BLOCK_SCALES)
            acc3 = _fp8_stream_row(acc3, x_ptr, 3, stride_xm, k, k_ok & (3 < M), w, s, BLOCK_SCALES)
    row_scale = 1.0
    if not BLOCK_SCALES:
        row_scale = tl.load(scale_ptr + n.to(tl.int64) * stride_sn, mask=n_ok, other=0.0)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + n, mask=n_ok & (tl.program_id(1) == 0), other=0.0).to(tl.float32)
    _fp8_stream_out(out_ptr, acc0, 0, n, n_ok, stride_om, M, row_scale, bias, SPLIT_K, BLOCK_SCALES, HAS_BIAS)
    if M_PAD > 1:
        _fp8_stream_out(out_ptr, acc1, 1, n, n_ok, stride_om, M, row_scale, bias, SPLIT_K, BLOCK_SCALES, HAS_BIAS)
    if M_PAD > 2:
        _fp8_stream_out(out_ptr, acc2, 2, n, n_ok, stride_om, M, row_scale, bias, SPLIT_K, BLOCK_SCALES, HAS_BIAS)
        _fp8_stream_out(out_ptr, acc3, 3, n, n_ok, stride_om, M, row_scale, bias, SPLIT_K, BLOCK_SCALES, HAS_BIAS)


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
             block_scales: bool = False, launch: GemvLaunch | StreamLaunch | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; bf16, fp16 or fp32), weight float8_e4m3fn [N, K], weight_scale float32 [N, 1] or,
    block_scales, [ceil(N / 128), ceil(K / 128)] -> [M, N] in x's dtype: x @ dequantized(W).T (+ bias). The kernel
    is the launch's (StreamLaunch: the stream kernel; GemvLaunch: the tiles kernel); without one, SURGE_FP8_GEMV's
    with its policy."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"fp8_gemv takes up to {MAX_ROWS} rows, got {m}")
    check_fp8_weight(weight, weight_scale, k, block_scales)
    if x.stride(1) != 1:
        x = x.contiguous()
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    if launch is None:
        launch = stream_policy(m, n, k, _num_sms(x.device)) if envs.SURGE_FP8_GEMV == "stream" else \
            launch_policy(m, n, k)
    if isinstance(launch, StreamLaunch):
        return _launch_stream(x, weight, weight_scale, bias, block_scales, launch)
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


def _launch_stream(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                   block_scales: bool, launch: StreamLaunch) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, launch.block_k), launch.split_k) * launch.block_k
    split_k = triton.cdiv(k, k_per_split)  # every split non-empty
    split = split_k > 1
    out = (torch.zeros if split else torch.empty)(m, n, dtype=torch.float32 if split else x.dtype, device=x.device)
    weight_scale = weight_scale.contiguous()
    _fp8_stream_kernel[(triton.cdiv(n, launch.block_n), split_k)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k, k_per_split, x.stride(0),
        weight.stride(0), weight_scale.stride(0), out.stride(0), M_PAD=max(1, triton.next_power_of_2(m)),
        BLOCK_N=launch.block_n, CHUNKS=launch.chunks, BLOCK_SCALES=block_scales, HAS_BIAS=bias is not None,
        SPLIT_K=split_k, NUM_STAGES=launch.num_stages, num_warps=launch.num_warps)
    return out.to(x.dtype) if split else out


@cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H200_SMS
