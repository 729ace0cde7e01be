"""Fused mixture of experts in Triton: the (token, expert) pairs sorted by expert and padded per expert to whole
blocks of rows, one grouped GEMM for gate|up with its bias (optional) and the gated activation (SiLU, or gpt-oss's
clamped SwiGLU) fused into its epilogue, one for down with its bias and the router weight fused into its epilogue,
then the k weighted rows of each token summed by one more kernel.

Every shape is static (the padded pair count is its upper bound, blocks past the live ones exit at once), so one
CUDA graph replays any routing. Defined by surge/kernels/reference.py's fused_moe; ids of -1 (experts another rank
holds) contribute nothing. The alignment is surge/kernels/moe_routing.py's.

Quantized experts are the same two kernels compiled for another QUANT (MoeQuant): fp8 weights with bn x bk block
scales (128 x 128 in the checkpoints; any bn, bk a power of two: the K tile narrows to bk) and 1 x bk dynamic
activation groups (the scales applied per K tile), fp8 with per-channel (or per-tensor)
weight scales and per-token (or static) activation scales (applied once after the K loop), or MXFP4 weights decoded
to bf16 in registers (a 16-entry e2m1 table, the e8m0 scale a power of two). The reference is the same loop on the
dequantized weights, activations quantized and dequantized alike (quant_reference).

Few tokens (decode: at most one pair per expert on average, MoeLaunch.pairs set by launch_policy) take the pair
path instead: no alignment and no combine launch. One GEMV-like program per (pair, block of gate|up rows) streams
that block of its expert's rows (evicted first: read once), multiplies by the token's row in float32 and applies
the activation; then one program per (token, block of hidden columns) runs the down projection of its k pairs in
slot order, weights them and sums them in float32 (the combine, fused). Blocks of rows are small so that there are
several programs per SM (enough loads in flight to cover the memory latency); a pair's program reads only its
expert, so an expert that two pairs chose is read twice, from L2 the second time while their programs run
together (the grid puts the pairs of one row block next to each other). Bias and every activation alike; the
quantized variants keep the grouped kernels. Qwen3-30B-A3B at batch 1 (compiled for sm_90: scripts/triton_sass.py):
gate|up 768 programs of 8 x 256 rows x columns a step (gate and up: 8 KB), 40 registers a thread; down 512 programs
of 8 experts x 4 x 256 a step (16 KB), 64 registers; both all resident at once, 6-8 MB in flight, above HBM3e's
bandwidth-latency product (~5 MB), with 16-byte loads and no shared memory or barrier in their K loops. To be
confirmed on the H200 by `bench kernels --only moe` (and tuned by `--only moe-sweep`).

Each call dispatches a MoeKey (its layer's shapes, the launch policies at its token count, and how Triton
specializes the arguments that follow the token count) to FUSED_MOE, a CompiledKernel: the engine's kernel warm-up
compiles the keys of every CUDA graph's token count beforehand (surge/model/layers/moe.py's moe_kernel_keys), by
running this same code on meta tensors with each launch compiled instead of run (warmup.compile_only).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import triton
import triton.language as tl

from surge.kernels.moe_routing import align_launch, align_to_blocks, max_padded_pairs
from surge.kernels.reference import EXPERT_ACTIVATIONS
from surge.kernels.warmup import CompiledKernel, compile_only, compiling, triton_int_class
from surge.kernels.warmup import launch as launch_kernel

# Rows of a block: tl.dot needs at least 16; more than 64 with two accumulators (gate and up) spills registers.
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PairTiles:
    """A pair-path kernel's [block_n, block_k] weight tile per load (block_n output rows, block_k of the K axis)."""
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1  # > 1: Triton's software pipeline (cp.async) keeps later K steps' loads in flight


@dataclass(frozen=True)
class PairLaunch:
    gate_up: PairTiles  # programs: pairs x cdiv(intermediate, block_n)
    down: PairTiles  # programs: tokens x cdiv(hidden, block_n), each over its k pairs


@dataclass(frozen=True)
class MoeLaunch:
    block_m: int  # rows (pairs) per block: each expert's pairs are padded to a multiple of it
    gate_up: GemmTiles  # N: the intermediate size (gate and up both), K: hidden
    down: GemmTiles  # N: hidden, K: the intermediate size
    combine_block: int = 1024  # hidden columns per program of the weighted rows' sum
    pairs: PairLaunch | None = None  # set: the pair path (no alignment, no combine) instead of the grouped GEMMs


def _tiles(block_m: int, n: int, k: int) -> GemmTiles:
    """Few rows per block (decode) read weights: wide K tiles, deep pipelines. Many rows (prefill) reuse each weight
    tile: square tiles."""
    block_n = min(64 if block_m <= 32 else 128, max(16, triton.next_power_of_2(n)))
    block_k = min(128 if block_m <= 32 else 64, max(16, triton.next_power_of_2(k)))
    return GemmTiles(block_n, block_k, num_warps=4, num_stages=4 if block_m <= 32 else 3)


# The pair path while the pairs are at most this many per expert (on average): beyond, experts chosen by several
# pairs are streamed once by the grouped GEMMs instead of once per pair.
PAIR_PATH_MAX_PAIRS_PER_EXPERT = 1
# Programs the pair path aims for: about four on each of an H100's / H200's 132 SMs, several resident at once (at
# ~64 registers a thread, eight fit an SM), so that enough weight bytes are in flight to cover the memory latency.
# A program's weight loads a K step: up to PAIR_STEP_ELEMENTS (16 KB of bf16; gate|up: a gate and an up tile, down:
# the token's k experts' tiles), each row's stretch from MIN_PAIR_BLOCK_K (128 contiguous bytes) to
# MAX_PAIR_BLOCK_K: one warp's 32 lanes of 16-byte loads, so that the reduction over K stays within a warp (shuffles,
# no shared memory and barriers each step).
PAIR_PROGRAMS, PAIR_STEP_ELEMENTS = 512, 8192
MIN_PAIR_BLOCK_N, MAX_PAIR_BLOCK_N, MIN_PAIR_BLOCK_K, MAX_PAIR_BLOCK_K = 4, 64, 64, 256


def _pair_tiles(programs_per_block_row: int, tiles: int, n: int, k: int) -> PairTiles:
    """The widest block of output rows (a power of two, from MIN_PAIR_BLOCK_N up to MAX_PAIR_BLOCK_N and to what
    leaves MIN_PAIR_BLOCK_K for each of the step's `tiles` tiles) that still gives PAIR_PROGRAMS programs, and the
    K stretch that fills the step (at most MAX_PAIR_BLOCK_K and K padded): few rows, a long contiguous stretch of
    each (16-byte loads)."""
    widest = min(MAX_PAIR_BLOCK_N, max(MIN_PAIR_BLOCK_N, PAIR_STEP_ELEMENTS // (tiles * MIN_PAIR_BLOCK_K)))
    block_n = MIN_PAIR_BLOCK_N
    while block_n < widest and programs_per_block_row * triton.cdiv(n, 2 * block_n) >= PAIR_PROGRAMS:
        block_n *= 2
    block_n = min(block_n, max(MIN_PAIR_BLOCK_N, triton.next_power_of_2(n)))
    block_k = min(MAX_PAIR_BLOCK_K, max(16, triton.next_power_of_2(k)),
                  max(16, PAIR_STEP_ELEMENTS // (tiles * block_n)))
    return PairTiles(block_n, block_k)


def pair_launch(num_tokens: int, top_k: int, hidden: int, intermediate: int) -> PairLaunch:
    """The pair path's tiles: gate|up (a gate and an up tile a step) over the tokens' pairs, down (the k experts'
    tiles a step) over the tokens."""
    return PairLaunch(_pair_tiles(num_tokens * top_k, 2, intermediate, hidden),
                      _pair_tiles(num_tokens, triton.next_power_of_2(top_k), hidden, intermediate))


def launch_policy(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int,
                  quant: str = "none") -> MoeLaunch:
    """Pure function of shapes: the batch's token count (a CUDA graph's capture size under graphs, never a live
    routing), the experts and the projections. block_m covers the pairs an expert receives on average. The pair
    path (unquantized experts only) while the pairs are at most PAIR_PATH_MAX_PAIRS_PER_EXPERT per expert."""
    for name, value in (("num_tokens", num_tokens), ("top_k", top_k), ("num_experts", num_experts),
                        ("hidden", hidden), ("intermediate", intermediate)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be <= num_experts={num_experts}")
    pairs_per_expert = triton.cdiv(num_tokens * top_k, num_experts)
    block_m = min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(pairs_per_expert)))
    # The gate|up GEMM's N is each half's width: one program computes a tile of gate and the same tile of up.
    pairs = None
    if quant == "none" and num_tokens * top_k <= PAIR_PATH_MAX_PAIRS_PER_EXPERT * num_experts:
        pairs = pair_launch(num_tokens, top_k, hidden, intermediate)
    return MoeLaunch(block_m, _tiles(block_m, intermediate, hidden), _tiles(block_m, hidden, intermediate),
                     combine_block=min(1024, max(16, triton.next_power_of_2(hidden))), pairs=pairs)


# e2m1 magnitudes (codes 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6) in quarters, 5 bits each: the MXFP4 decode table, held
# in one 64-bit register and indexed by shifting (code 8..15 are the same magnitudes negated).
E2M1_QUARTERS = sum(q << (5 * i) for i, q in enumerate((0, 2, 4, 6, 8, 12, 16, 24)))


@triton.jit
def _weight_tile(w_rows, scale_rows, k0, K, col_ok, BLOCK_K: tl.constexpr, QUANT: tl.constexpr,
                 E2M1_TABLE: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile W[n, k0 + i] (transposed) of one expert's rows n: w_rows and scale_rows point at
    each row's start. mxfp4 rows hold bytes (value k in byte k // 2, the low nibble first) and one e8m0 scale per 32
    values (K and BLOCK_K multiples of 32): the tile's bytes and scales load contiguous along K, unpack by shifts and
    reshapes, and come back as bf16 (exact: an e2m1 value times a power of two). Other variants load as stored."""
    if QUANT == "mxfp4":
        BLOCK_N: tl.constexpr = w_rows.shape[0]
        byte_ids = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(w_rows[:, None] + byte_ids[None, :], mask=col_ok[:, None] & (byte_ids < K // 2)[None, :],
                       other=0).to(tl.int32)
        code = (byte[:, :, None] >> (tl.arange(0, 2) * 4)[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K / 2, 2]
        quarters = (E2M1_TABLE >> ((code & 7) * 5).to(tl.int64)) & 31
        value = tl.where(code >= 8, -quarters.to(tl.float32), quarters.to(tl.float32)) * 0.25
        block_ids = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        exponent = tl.load(scale_rows[:, None] + block_ids[None, :],
                           mask=col_ok[:, None] & (block_ids < K // 32)[None, :], other=127).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)  # 2^(e - 127); e = 0 (2^-127) reads as 0
        value = tl.reshape(value, (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None]
        tile = tl.trans(tl.reshape(value, (BLOCK_N, BLOCK_K)).to(tl.bfloat16))
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w_rows[None, :] + k[:, None], mask=(k < K)[:, None] & col_ok[None, :], other=0.0)
    return tile


@triton.jit
def _activate(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """reference.expert_activation on float32 gate and up."""
    if ACTIVATION == "swiglu_oai":
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    elif ACTIVATION == "silu_clamped":
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate / (1.0 + tl.exp(-gate)) * up
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up
    return act


@triton.jit
def _gate_up_act_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
                        num_pairs, N, K, stride_xm, stride_xsm, stride_xsk, stride_we, stride_wn, stride_wse,
                        stride_wsn, up_scale_row, stride_be, stride_om, alpha, limit,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                        QUANT: tl.constexpr, QUANT_BLOCK_N: tl.constexpr, QUANT_BLOCK_K: tl.constexpr,
                        E2M1_TABLE: tl.constexpr):
    """out[pair, n] = act(gate, up) with gate = x[token] . w[e, n] (+ bias[e, n]), up = x[token] . w[e, N + n]
    (+ bias[e, N + n]) for this block's pairs of expert e; act as reference.expert_activation. QUANT: "none";
    "fp8_block" (x fp8 with scales [T, K / QUANT_BLOCK_K], w fp8 with [E, rows / QUANT_BLOCK_N, K / QUANT_BLOCK_K],
    up's block rows from up_scale_row, applied per K tile: BLOCK_K divides QUANT_BLOCK_K, so a tile is in one
    block); "fp8_channel" (x fp8 with [T] scales, w with [E, 2N] scales, applied once); "mxfp4" (w decoded in
    _weight_tile)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pair < num_pairs
        token = (pair // TOP_K).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        cols64 = cols.to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        a_rows = x_ptr + token * stride_xm
        g_rows = w_ptr + expert * stride_we + cols64 * stride_wn
        u_rows = g_rows + N * stride_wn
        if QUANT == "fp8_block":
            g_scale_rows = w_scale_ptr + expert * stride_wse + (cols64 // QUANT_BLOCK_N) * stride_wsn
            u_scale_rows = g_scale_rows + up_scale_row * stride_wsn
        else:  # one scale row per weight row (mxfp4, fp8_channel: [E, 2N]); unused without quantization
            g_scale_rows = w_scale_ptr + expert * stride_wse + cols64 * stride_wsn
            u_scale_rows = g_scale_rows + N * stride_wsn
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            a = tl.load(a_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = _weight_tile(g_rows, g_scale_rows, k0, K, col_ok, BLOCK_K, QUANT, E2M1_TABLE)
            u = _weight_tile(u_rows, u_scale_rows, k0, K, col_ok, BLOCK_K, QUANT, E2M1_TABLE)
            if QUANT == "fp8_block":
                a_scale = tl.load(x_scale_ptr + token * stride_xsm + (k0 // QUANT_BLOCK_K) * stride_xsk, mask=row_ok,
                                  other=0.0)
                g_scale = tl.load(g_scale_rows + k0 // QUANT_BLOCK_K, mask=col_ok, other=0.0)
                u_scale = tl.load(u_scale_rows + k0 // QUANT_BLOCK_K, mask=col_ok, other=0.0)
                gate += tl.dot(a, g) * (a_scale[:, None] * g_scale[None, :])
                up += tl.dot(a, u) * (a_scale[:, None] * u_scale[None, :])
            else:
                gate = tl.dot(a, g, gate, input_precision=DOT_PRECISION)
                up = tl.dot(a, u, up, input_precision=DOT_PRECISION)
        if QUANT == "fp8_channel":
            a_scale = tl.load(x_scale_ptr + token * stride_xsm, mask=row_ok, other=0.0)[:, None]
            gate *= a_scale * tl.load(g_scale_rows, mask=col_ok, other=0.0)[None, :]
            up *= a_scale * tl.load(u_scale_rows, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            b_ptrs = bias_ptr + expert * stride_be + cols
            gate += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptrs + N, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        act = _activate(gate, up, alpha, limit, ACTIVATION)
        out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_weighted_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, sorted_ids_ptr,
                          block_expert_ptr, weights_ptr, num_pairs, N, K, stride_am, stride_asm, stride_ask,
                          stride_we, stride_wn, stride_wse, stride_wsn, stride_be, stride_om,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, QUANT: tl.constexpr,
                          QUANT_BLOCK_N: tl.constexpr, QUANT_BLOCK_K: tl.constexpr, E2M1_TABLE: tl.constexpr):
    """out[pair, n] = weight[pair] * (a[pair] . w[e, n] (+ bias[e, n])) for this block's pairs of expert e; QUANT as
    in _gate_up_act_kernel, the activation scales per pair."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pair < num_pairs
        pair64 = pair.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        cols64 = cols.to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + pair64 * stride_am
        w_rows = w_ptr + expert * stride_we + cols64 * stride_wn
        if QUANT == "fp8_block":
            scale_rows = w_scale_ptr + expert * stride_wse + (cols64 // QUANT_BLOCK_N) * stride_wsn
        else:
            scale_rows = w_scale_ptr + expert * stride_wse + cols64 * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            a = tl.load(a_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = _weight_tile(w_rows, scale_rows, k0, K, col_ok, BLOCK_K, QUANT, E2M1_TABLE)
            if QUANT == "fp8_block":
                a_scale = tl.load(a_scale_ptr + pair64 * stride_asm + (k0 // QUANT_BLOCK_K) * stride_ask, mask=row_ok,
                                  other=0.0)
                w_scale = tl.load(scale_rows + k0 // QUANT_BLOCK_K, mask=col_ok, other=0.0)
                acc += tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])
            else:
                acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if QUANT == "fp8_channel":
            acc *= (tl.load(a_scale_ptr + pair64 * stride_asm, mask=row_ok, other=0.0)[:, None]
                    * tl.load(scale_rows, mask=col_ok, other=0.0)[None, :])
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        weight = tl.load(weights_ptr + pair64, mask=row_ok, other=0.0).to(tl.float32)
        out_ptrs = out_ptr + pair64[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(rows_ptr, ids_ptr, out_ptr, hidden, expert_offset, num_experts, TOP_K: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """out[t] = the sum over slots j of rows[t * TOP_K + j], in float32 in slot order, skipping the pairs whose
    expert another rank holds (their rows are never written)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        local = tl.load(ids_ptr + pair).to(tl.int32) - expert_offset
        here = (local >= 0) & (local < num_experts)
        acc += tl.load(rows_ptr + pair * hidden + cols, mask=col_ok & here, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _pair_gate_up_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, ids_ptr, expert_offset, num_experts, N, K, stride_xm,
                         stride_we, stride_wn, stride_be, stride_om, alpha, limit, TOP_K: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                         ACTIVATION: tl.constexpr, NUM_STAGES: tl.constexpr):
    """out[pair, n] = act(gate, up) for n in this program's block, gate = x[token] . w[e, n] (+ bias[e, n]),
    up = x[token] . w[e, N + n] (+ bias[e, N + n]), e the pair's (local) expert; nothing for another rank's expert.
    Grid (pairs, row blocks): the pairs of one row block run next to each other. Products summed elementwise in
    float32."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int32) - expert_offset
    if (expert >= 0) & (expert < num_experts):
        token = (pair // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        g_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        u_rows = g_rows + N * stride_wn
        # x broadcast over the block's rows in the load itself (the repeats hit L1): loaded straight into the
        # weights' layout, where a [BLOCK_K] vector would be redistributed through shared memory each step.
        x_rows = x_ptr + token * stride_xm + 0 * cols[:, None]
        gate_n = tl.zeros((BLOCK_N,), dtype=tl.float32)
        up_n = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k = (k0 + tl.arange(0, BLOCK_K))[None, :]
            tile_ok = col_ok[:, None] & (k < K)
            x = tl.load(x_rows + k, mask=tile_ok, other=0.0).to(tl.float32)
            g = tl.load(g_rows + k, mask=tile_ok, other=0.0, eviction_policy="evict_first")
            u = tl.load(u_rows + k, mask=tile_ok, other=0.0, eviction_policy="evict_first")
            # Reduced each step (a few shuffles): an elementwise accumulator would hold twice the tile in
            # registers, and fewer programs would fit an SM.
            gate_n += tl.sum(g.to(tl.float32) * x, axis=1)
            up_n += tl.sum(u.to(tl.float32) * x, axis=1)
        if HAS_BIAS:
            b_ptrs = bias_ptr + expert.to(tl.int64) * stride_be + cols
            gate_n += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)
            up_n += tl.load(b_ptrs + N, mask=col_ok, other=0.0).to(tl.float32)
        act = _activate(gate_n, up_n, alpha, limit, ACTIVATION)
        tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, act.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _token_down_kernel(a_ptr, w_ptr, bias_ptr, weights_ptr, ids_ptr, out_ptr, expert_offset, num_experts, N, K,
                       stride_am, stride_we, stride_wn, stride_be, stride_om, TOP_K: tl.constexpr,
                       TOP_K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr):
    """out[t, n] = the sum over slots j, in float32, of weight[t, j] * (a[t * TOP_K + j] . w[e_j, n] (+ bias[e_j,
    n])), skipping the slots whose expert another rank holds (their rows of a were never written, their loads are
    masked off): the down projection, the router weight and the combine in one kernel. The token's k experts are
    read together, one [TOP_K_PAD, BLOCK_N, BLOCK_K] tile a step: the ids are one load and every step's weight
    loads are issued at once (a loop over the slots would wait on each slot's loads in turn)."""
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, TOP_K_PAD)
    pairs = token * TOP_K + slots
    expert = tl.load(ids_ptr + pairs, mask=slots < TOP_K, other=-1).to(tl.int32) - expert_offset
    here = (slots < TOP_K) & (expert >= 0) & (expert < num_experts)
    expert64 = tl.where(here, expert, 0).to(tl.int64)
    weight = tl.load(weights_ptr + pairs, mask=here, other=0.0).to(tl.float32)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = w_ptr + expert64[:, None, None] * stride_we + cols.to(tl.int64)[None, :, None] * stride_wn
    # a's rows broadcast over the block's columns in the loads themselves (the repeats hit L1): loaded straight into
    # the weights' layout, where a [TOP_K_PAD, 1, BLOCK_K] tile would be redistributed through shared memory.
    a_rows = a_ptr + pairs[:, None, None] * stride_am + 0 * cols[None, :, None]
    rows_ok = here[:, None, None] & col_ok[None, :, None]
    y = tl.zeros((TOP_K_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = (k0 + tl.arange(0, BLOCK_K))[None, None, :]
        k_ok = k < K
        a = tl.load(a_rows + k, mask=rows_ok & k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k, mask=rows_ok & k_ok, other=0.0, eviction_policy="evict_first")
        y += tl.sum(w.to(tl.float32) * a, axis=2)  # each step (as in _pair_gate_up_kernel)
    if HAS_BIAS:
        y += tl.load(bias_ptr + expert64[:, None] * stride_be + cols[None, :], mask=here[:, None] & col_ok[None, :],
                     other=0.0).to(tl.float32)
    total = tl.sum(tl.where(here[:, None], y * weight[:, None], 0.0), axis=0)
    tl.store(out_ptr + token * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


QUANT_METHODS = ("fp8_block", "fp8_channel", "mxfp4")
FP8_BLOCK = 128  # DeepSeek / Qwen3-FP8 blocks: 128 x 128 weight blocks, 1 x 128 activation groups
FP8_MIN_TILE_K = 32  # tl.dot's smallest K for fp8 operands (sm_90 compiles no fp8 dot over 16)


def fp8_block_fits(block: tuple[int, int]) -> bool:
    """Whether the fp8_block variant takes weight blocks (rows bn, columns bk): any bn (a scale row per column of
    the output tile); bk a power of two >= 32, so that a K tile (a power of two from 32 to bk) lies in one block
    and the activations' 1 x bk groups are per_token_group_quant_fp8's."""
    bn, bk = block
    return bn >= 1 and bk >= FP8_MIN_TILE_K and bk & (bk - 1) == 0


@dataclass(frozen=True)
class MoeQuant:
    """Quantized experts: the kernels' compile-time variant and its scales. gate_up and down then hold:

    - fp8_block: float8_e4m3fn [E, 2I, H] and [E, H, I] in blocks of `block` = (bn, bk) (128 x 128 in DeepSeek's and
      Qwen3's checkpoints; fp8_block_fits says which the kernels take); gate_up_scale float32
      [E, 2 * ceil(I / bn), ceil(H / bk)] (gate's block rows, then up's: a checkpoint's two weight_scale_inv
      stacked), down_scale [E, ceil(H / bn), ceil(I / bk)]. Activations quantized dynamically per token and
      bk columns (per_token_group_quant_fp8).
    - fp8_channel: float8_e4m3fn weights; gate_up_scale float32 [E, 2I] and down_scale [E, H] per output row, or
      [E, 1] (per tensor, broadcast). Activations per token, dynamically, or with a static per-tensor scale
      (gate_up_input_scale, down_input_scale: one float32 value each; a checkpoint's per-expert input_scale's max).
    - mxfp4 (gpt-oss): uint8 blocks [E, 2I, H / 32, 16] and [E, H, I / 32, 16] (two e2m1 per byte, low nibble
      first), e8m0 scales uint8 gate_up_scale [E, 2I, H / 32], down_scale [E, H, I / 32]; bf16 activations. gpt-oss
      interleaves gate and up rows: deinterleave_gate_up first.
    """
    method: str
    gate_up_scale: torch.Tensor
    down_scale: torch.Tensor
    gate_up_input_scale: torch.Tensor | None = None
    down_input_scale: torch.Tensor | None = None
    block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)  # fp8_block's weight blocks (rows, columns)

    def __post_init__(self):
        if self.method not in QUANT_METHODS:
            raise ValueError(f"MoE quantization {self.method!r} is not supported; supported: "
                             f"{', '.join(QUANT_METHODS)}")
        if self.method == "fp8_block" and not fp8_block_fits(self.block):
            raise ValueError(f"fp8_block block={self.block}: the kernels take blocks (bn, bk) with bk a power of two "
                             f">= {FP8_MIN_TILE_K}")


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate_up rows (gate, up, gate, up, ...) along dim 1 -> [gate rows | up rows], for its blocks, scales
    and bias alike. Once, at load."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()


def _logical_weight(w: torch.Tensor, quant: MoeQuant | None) -> tuple[torch.Tensor, int]:
    """(the weight as the kernel addresses it: [E, rows, K] elements, or [E, rows, K / 2] bytes for mxfp4; K)."""
    if quant is not None and quant.method == "mxfp4":
        if w.dim() != 4 or w.shape[-1] != 16 or w.dtype != torch.uint8:
            raise ValueError(f"mxfp4 expert blocks must be uint8 [E, rows, K / 32, 16], got {w.dtype} "
                             f"{tuple(w.shape)}")
        return w.flatten(2), w.shape[2] * 32
    if quant is not None and w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{quant.method} expert weights must be float8_e4m3fn, got {w.dtype}")
    return w, w.shape[2]


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, launch: MoeLaunch | None = None, expert_offset: int = 0, *,
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
              quant: MoeQuant | None = None) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] ([gate | up] rows); down [E, H, I]; topk_weights, topk_ids [T, k]; optional
    biases gate_up_bias [E, 2I], down_bias [E, H]; activation one of reference.EXPERT_ACTIVATIONS; quant: quantized
    weights (MoeQuant says their layouts). Returns [T, H] in x's dtype. Four launches: alignment, gate|up, down,
    combine (fp8: two more, each GEMM's activation quantization); two on the pair path (launch.pairs).

    This rank holds experts [expert_offset, expert_offset + E) of the ids (global ones under expert parallelism;
    local ones, -1 for another rank's, with the default 0): any other id contributes nothing."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    (num_experts, two_inter, _), gate_up_k = gate_up.shape[:3], _logical_weight(gate_up, quant)[1]
    inter = two_inter // 2
    down_shape = (down.shape[0], down.shape[1], _logical_weight(down, quant)[1])
    if gate_up_k != hidden or down_shape != (num_experts, hidden, inter):
        raise ValueError(f"expert weights gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit "
                         f"hidden size {hidden}")
    for name, bias, want in (("gate_up_bias", gate_up_bias, (num_experts, two_inter)),
                             ("down_bias", down_bias, (num_experts, hidden))):
        if bias is not None and tuple(bias.shape) != want:
            raise ValueError(f"{name} of shape {tuple(bias.shape)}, expected {want}")
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; supported: {', '.join(EXPERT_ACTIVATIONS)}")
    if num_tokens == 0:
        return torch.zeros_like(x)
    launch = launch or launch_policy(num_tokens, top_k, num_experts, hidden, inter,
                                     "none" if quant is None else quant.method)
    if launch.pairs is not None and quant is not None:
        raise ValueError(f"launch={launch} takes the pair path, which has no {quant.method} variant")
    if not compiling():  # (FusedMoeKernels.compile runs this function on meta tensors)
        FUSED_MOE.ensure(FUSED_MOE.dispatch(num_tokens, MoeExperts.of(
            x, gate_up, down, topk_weights, topk_ids, expert_offset, gate_up_bias, down_bias, activation, quant),
            launch))
    if launch.pairs is not None:
        return pair_experts(x, gate_up, down, topk_weights, topk_ids, launch.pairs, expert_offset,
                            gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation,
                            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    sorted_ids, block_expert = align_to_blocks(topk_ids, num_experts, launch.block_m, expert_offset)
    return grouped_experts(x, gate_up, down, topk_weights, topk_ids, sorted_ids, block_expert, launch, expert_offset,
                           gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation,
                           swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, quant=quant)


Layout = tuple[tuple[int, ...], torch.dtype]  # a tensor's shape and dtype (the kernels take them contiguous)


def _layout(t: torch.Tensor | None) -> Layout | None:
    return None if t is None else (tuple(t.shape), t.dtype)


def _meta(layout: Layout | None) -> torch.Tensor | None:
    return None if layout is None else torch.empty(layout[0], dtype=layout[1], device="meta")


@dataclass(frozen=True)
class MoeExperts:
    """What of one layer's fused_moe call, besides the token count, decides its kernel variants: the tensors'
    shapes and dtypes (a layer's constants), the activation, the quantization and this rank's first expert."""
    x_dtype: torch.dtype
    topk_weights_dtype: torch.dtype
    topk_ids_dtype: torch.dtype  # int32 from the router kernel, int64 from torch.topk
    top_k: int
    gate_up: Layout
    down: Layout
    gate_up_bias: Layout | None = None
    down_bias: Layout | None = None
    activation: str = "silu"
    expert_offset: int = 0
    quant: str = "none"
    quant_block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    scales: tuple[Layout | None, ...] = ()  # MoeQuant's gate_up_scale, down_scale and input scales

    @classmethod
    def of(cls, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, expert_offset: int = 0, gate_up_bias: torch.Tensor | None = None,
           down_bias: torch.Tensor | None = None, activation: str = "silu",
           quant: MoeQuant | None = None) -> MoeExperts:
        """fused_moe's arguments' (x and the routing only for their dtypes and top_k)."""
        scales = () if quant is None else tuple(_layout(t) for t in (
            quant.gate_up_scale, quant.down_scale, quant.gate_up_input_scale, quant.down_input_scale))
        return cls(x.dtype, topk_weights.dtype, topk_ids.dtype, topk_ids.shape[-1], _layout(gate_up), _layout(down),
                   _layout(gate_up_bias), _layout(down_bias), activation, expert_offset,
                   "none" if quant is None else quant.method, (FP8_BLOCK, FP8_BLOCK) if quant is None else quant.block,
                   scales)

    def sizes(self) -> tuple[int, int, int]:
        """(experts, hidden, intermediate): mxfp4 weights hold 32 values in 16 bytes per K block."""
        per_block = 32 if self.quant == "mxfp4" else 1
        return self.gate_up[0][0], self.gate_up[0][2] * per_block, self.down[0][2] * per_block


@dataclass(frozen=True)
class MoeKey:
    experts: MoeExperts
    launch: MoeLaunch
    # The grouped path's alignment: one launch or two, and its compile-time tiles (pairs, experts, blocks a step)
    align: tuple[bool, int, int, int] | None
    # triton_int_class of each kernel argument that follows the token count: tokens, pairs, blocks of pairs, and
    # the alignment's pairs per program, programs and blocks per program
    token_classes: tuple[int, ...]
    num_tokens: int = field(default=1, compare=False)  # one token count of the key, for compile


class FusedMoeKernels(CompiledKernel):
    """fused_moe's variants, routing's alignment included (one wrapper per process: FUSED_MOE). A key covers one
    layer's launches at one token count; compile runs fused_moe itself on meta tensors, compiling each launch."""
    parallel_compile = True

    def dispatch(self, num_tokens: int, experts: MoeExperts, launch: MoeLaunch | None = None) -> MoeKey:
        """launch: fused_moe's (by default its launch_policy)."""
        num_experts, hidden, inter = experts.sizes()
        launch = launch or launch_policy(num_tokens, experts.top_k, num_experts, hidden, inter, experts.quant)
        num_pairs = num_tokens * experts.top_k
        align, classes = None, (triton_int_class(num_tokens), triton_int_class(num_pairs))
        if launch.pairs is None:
            a = align_launch(num_pairs, num_experts, launch.block_m)
            align = (a.num_programs == 1, a.pairs_per_step, a.experts_pad, a.blocks_per_step)
            num_blocks = max_padded_pairs(num_pairs, num_experts, launch.block_m) // launch.block_m
            classes += tuple(triton_int_class(v) for v in (num_blocks, a.chunk, a.num_programs,
                                                           triton.cdiv(num_blocks, a.num_programs)))
        return MoeKey(experts, launch, align, classes, num_tokens)

    def compile(self, key: MoeKey) -> object:
        e, t = key.experts, key.num_tokens
        quant = None
        if e.quant != "none":
            quant = MoeQuant(e.quant, *(_meta(s) for s in e.scales), block=e.quant_block)
        x = torch.empty(t, e.sizes()[1], dtype=e.x_dtype, device="meta")
        weights = torch.empty(t, e.top_k, dtype=e.topk_weights_dtype, device="meta")
        ids = torch.empty(t, e.top_k, dtype=e.topk_ids_dtype, device="meta")
        with compile_only():
            return fused_moe(x, _meta(e.gate_up), _meta(e.down), weights, ids, key.launch, e.expert_offset,
                             gate_up_bias=_meta(e.gate_up_bias), down_bias=_meta(e.down_bias),
                             activation=e.activation, quant=quant)


FUSED_MOE = FusedMoeKernels()


def _quantize_rows(a: torch.Tensor, method: str, static_scale: torch.Tensor | None, group: int
                   ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A GEMM's fp8 input: (q, scales, the scales' row stride, their K-group stride); fp8_block: groups of `group`
    columns."""
    from surge.kernels.fp8_quant import (per_token_group_quant_fp8, scaled_fp8_quant_per_tensor,
                                         scaled_fp8_quant_per_token)

    if compiling():  # FusedMoeKernels.compile, on meta tensors: the quantization kernels' outputs' layouts alone
        q = torch.empty(a.shape, dtype=torch.float8_e4m3fn, device=a.device)
        if method == "fp8_block":
            scale = torch.empty(triton.cdiv(a.shape[1], group), a.shape[0], device=a.device).t()
            return q, scale, scale.stride(0), scale.stride(1)
        if static_scale is not None:
            return q, static_scale.reshape(1), 0, 0
        scale = torch.empty(a.shape[0], 1, device=a.device)
        return q, scale, scale.stride(0), 0
    if method == "fp8_block":
        q, scale = per_token_group_quant_fp8(a, group)
        return q, scale, scale.stride(0), scale.stride(1)
    if static_scale is not None:
        q, scale = scaled_fp8_quant_per_tensor(a, static_scale)
        return q, scale, 0, 0  # every row reads the one scale
    q, scale = scaled_fp8_quant_per_token(a)
    return q, scale, scale.stride(0), 0


def _check_scales(quant: MoeQuant, gate_up: torch.Tensor, down: torch.Tensor, hidden: int, inter: int) -> None:
    num_experts = gate_up.shape[0]
    if quant.method == "fp8_block":
        bn, bk = quant.block
        want = {"gate_up_scale": (num_experts, 2 * triton.cdiv(inter, bn), triton.cdiv(hidden, bk)),
                "down_scale": (num_experts, triton.cdiv(hidden, bn), triton.cdiv(inter, bk))}
    elif quant.method == "mxfp4":
        want = {"gate_up_scale": (num_experts, 2 * inter, hidden // 32),
                "down_scale": (num_experts, hidden, inter // 32)}
    else:
        want = {"gate_up_scale": [(num_experts, 2 * inter), (num_experts, 1)],
                "down_scale": [(num_experts, hidden), (num_experts, 1)]}
    for name, shapes in want.items():
        shape = tuple(getattr(quant, name).shape)
        if shape not in (shapes if isinstance(shapes, list) else [shapes]):
            raise ValueError(f"{quant.method} {name} of shape {shape}, expected {shapes}")


def _fp8_tiles(tiles: GemmTiles, widest: int | None) -> GemmTiles:
    block_k = max(tiles.block_k, FP8_MIN_TILE_K)
    return replace(tiles, block_k=block_k if widest is None else min(block_k, widest))


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, launch: MoeLaunch,
                    expert_offset: int = 0, *, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, activation: str = "silu", swiglu_alpha: float = 1.702,
                    swiglu_limit: float = 7.0, quant: MoeQuant | None = None) -> torch.Tensor:
    """fused_moe after its alignment (sorted_ids, block_expert from align_to_blocks with launch.block_m): the two
    GEMMs and the combine. Apart so that a benchmark times them without the routing."""
    num_tokens, hidden = x.shape
    gate_up, _ = _logical_weight(gate_up.contiguous(), quant)
    down, inter = _logical_weight(down.contiguous(), quant)
    num_experts, top_k = gate_up.shape[0], topk_ids.shape[1]
    method = "none" if quant is None else quant.method
    if quant is not None:
        _check_scales(quant, gate_up, down, hidden, inter)
    if method == "mxfp4" and x.dtype != torch.bfloat16:
        raise ValueError(f"mxfp4 experts take bf16 activations, got {x.dtype}")
    if method in ("fp8_block", "fp8_channel"):  # fp8 dots at least 32 deep; fp8_block's K tiles within one weight
        # block and activation group: at most bk wide (both powers of two)
        widest = quant.block[1] if method == "fp8_block" else None
        launch = replace(launch, gate_up=_fp8_tiles(launch.gate_up, widest), down=_fp8_tiles(launch.down, widest))
    if method == "mxfp4" and (hidden % 32 or inter % 32 or min(launch.gate_up.block_k, launch.down.block_k) < 32):
        raise ValueError(f"mxfp4 needs hidden ({hidden}) and intermediate ({inter}) sizes and K tiles that are "
                         f"multiples of 32, got {launch}")
    x = x.contiguous()
    num_pairs = num_tokens * top_k
    num_blocks = block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # Unused pointers (no bias, no scales) take the weight's place: never read.
    gate_up_scale = gate_up if quant is None else quant.gate_up_scale.contiguous()
    down_scale = down if quant is None else quant.down_scale.contiguous()
    a, a_scale, stride_asm, stride_ask = x, x, 0, 0
    if method in ("fp8_block", "fp8_channel"):
        a, a_scale, stride_asm, stride_ask = _quantize_rows(x, method, quant.gate_up_input_scale, quant.block[1])
    block_n, block_k = quant.block if quant is not None else (FP8_BLOCK, FP8_BLOCK)
    constants = dict(QUANT=method, QUANT_BLOCK_N=block_n, QUANT_BLOCK_K=block_k, E2M1_TABLE=E2M1_QUARTERS,
                     DOT_PRECISION=precision)

    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    t = launch.gate_up
    gate_up_b = gate_up if gate_up_bias is None else gate_up_bias.contiguous()
    up_scale_row = gate_up_scale.shape[1] // 2 if method == "fp8_block" else 0
    scale_row_stride = gate_up_scale.stride(1) if gate_up_scale.shape[1] > 1 else 0  # [E, 1]: one per expert
    launch_kernel(_gate_up_act_kernel, (num_blocks * triton.cdiv(inter, t.block_n),), (
        a, a_scale, gate_up, gate_up_scale, gate_up_b, act, sorted_ids, block_expert, num_pairs, inter, hidden,
        a.stride(0), stride_asm, stride_ask, gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0),
        scale_row_stride, up_scale_row, gate_up_b.stride(0), act.stride(0), float(swiglu_alpha), float(swiglu_limit)),
        dict(TOP_K=top_k, BLOCK_M=launch.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
             HAS_BIAS=gate_up_bias is not None, ACTIVATION=activation, num_warps=t.num_warps,
             num_stages=t.num_stages, **constants))

    a, a_scale, stride_asm, stride_ask = act, act, 0, 0
    if method in ("fp8_block", "fp8_channel"):
        a, a_scale, stride_asm, stride_ask = _quantize_rows(act, method, quant.down_input_scale, quant.block[1])
    rows = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # the rows of pairs held here
    t = launch.down
    down_b = down if down_bias is None else down_bias.contiguous()
    scale_row_stride = down_scale.stride(1) if down_scale.shape[1] > 1 else 0
    launch_kernel(_down_weighted_kernel, (num_blocks * triton.cdiv(hidden, t.block_n),), (
        a, a_scale, down, down_scale, down_b, rows, sorted_ids, block_expert, topk_weights.contiguous(), num_pairs,
        hidden, inter, a.stride(0), stride_asm, stride_ask, down.stride(0), down.stride(1), down_scale.stride(0),
        scale_row_stride, down_b.stride(0), rows.stride(0)),
        dict(BLOCK_M=launch.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, HAS_BIAS=down_bias is not None,
             num_warps=t.num_warps, num_stages=t.num_stages, **constants))
    out = torch.empty_like(x)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    launch_kernel(_combine_kernel, (num_tokens, triton.cdiv(hidden, launch.combine_block)),
                  (rows, ids, out, hidden, expert_offset, num_experts),
                  dict(TOP_K=top_k, BLOCK_H=launch.combine_block, num_warps=4))
    return out


def pair_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, launch: PairLaunch, expert_offset: int = 0, *,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """fused_moe's pair path (unquantized experts): gate|up with the activation per (pair, row block), then down,
    router weight and combine per (token, column block). Two launches, no alignment, grids fixed by the shapes."""
    num_tokens, hidden = x.shape
    num_experts, two_inter = gate_up.shape[0], gate_up.shape[1]
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    t = launch.gate_up
    gate_up_b = gate_up if gate_up_bias is None else gate_up_bias.contiguous()  # unused pointer without a bias
    launch_kernel(_pair_gate_up_kernel, (num_tokens * top_k, triton.cdiv(inter, t.block_n)), (
        x, gate_up, gate_up_b, act, ids, expert_offset, num_experts, inter, hidden, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), gate_up_b.stride(0), act.stride(0), float(swiglu_alpha), float(swiglu_limit)),
        dict(TOP_K=top_k, BLOCK_N=t.block_n, BLOCK_K=t.block_k, HAS_BIAS=gate_up_bias is not None,
             ACTIVATION=activation, NUM_STAGES=t.num_stages, num_warps=t.num_warps))
    out = torch.empty_like(x)
    t = launch.down
    down_b = down if down_bias is None else down_bias.contiguous()
    launch_kernel(_token_down_kernel, (num_tokens, triton.cdiv(hidden, t.block_n)), (
        act, down, down_b, topk_weights.contiguous(), ids, out, expert_offset, num_experts, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), down_b.stride(0), out.stride(0)),
        dict(TOP_K=top_k, TOP_K_PAD=triton.next_power_of_2(top_k), BLOCK_N=t.block_n, BLOCK_K=t.block_k,
             HAS_BIAS=down_bias is not None, NUM_STAGES=t.num_stages, num_warps=t.num_warps))
    return out
