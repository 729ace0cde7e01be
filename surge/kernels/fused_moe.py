"""Fused mixture of experts in Triton: the (token, expert) pairs sorted by expert and padded per expert to whole
blocks of rows, one grouped GEMM for gate|up with its bias (optional) and the gated activation (SiLU, or gpt-oss's
clamped SwiGLU) fused into its epilogue, one for down with its bias and the router weight fused into its epilogue,
then the k weighted rows of each token summed by one more kernel.

Every shape is static (the padded pair count is its upper bound, blocks past the live ones exit at once), so one
CUDA graph replays any routing. Defined by surge/kernels/reference.py's fused_moe; ids of -1 (experts another rank
holds) contribute nothing. The alignment is surge/kernels/moe_routing.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.moe_routing import align_to_blocks
from surge.kernels.reference import EXPERT_ACTIVATIONS

# Rows of a block: tl.dot needs at least 16; more than 64 with two accumulators (gate and up) spills registers.
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeLaunch:
    block_m: int  # rows (pairs) per block: each expert's pairs are padded to a multiple of it
    gate_up: GemmTiles  # N: the intermediate size (gate and up both), K: hidden
    down: GemmTiles  # N: hidden, K: the intermediate size
    combine_block: int = 1024  # hidden columns per program of the weighted rows' sum


def _tiles(block_m: int, n: int, k: int) -> GemmTiles:
    """Few rows per block (decode) read weights: wide K tiles, deep pipelines. Many rows (prefill) reuse each weight
    tile: square tiles."""
    block_n = min(64 if block_m <= 32 else 128, max(16, triton.next_power_of_2(n)))
    block_k = min(128 if block_m <= 32 else 64, max(16, triton.next_power_of_2(k)))
    return GemmTiles(block_n, block_k, num_warps=4, num_stages=4 if block_m <= 32 else 3)


def launch_policy(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int) -> MoeLaunch:
    """Pure function of shapes: the batch's token count (a CUDA graph's capture size under graphs, never a live
    routing), the experts and the projections. block_m covers the pairs an expert receives on average."""
    for name, value in (("num_tokens", num_tokens), ("top_k", top_k), ("num_experts", num_experts),
                        ("hidden", hidden), ("intermediate", intermediate)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be <= num_experts={num_experts}")
    pairs_per_expert = triton.cdiv(num_tokens * top_k, num_experts)
    block_m = min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(pairs_per_expert)))
    # The gate|up GEMM's N is each half's width: one program computes a tile of gate and the same tile of up.
    return MoeLaunch(block_m, _tiles(block_m, intermediate, hidden), _tiles(block_m, hidden, intermediate),
                     combine_block=min(1024, max(16, triton.next_power_of_2(hidden))))


@triton.jit
def _gate_up_act_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, N, K,
                        stride_xm, stride_we, stride_wn, stride_be, stride_om, alpha, limit,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """out[pair, n] = act(gate, up) with gate = x[token] . w[e, n] (+ bias[e, n]), up = x[token] . w[e, N + n]
    (+ bias[e, N + n]) for this block's pairs of expert e; act as reference.expert_activation."""
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
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
        g_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [K, N] view
        u_ptrs = g_ptrs + N * stride_wn
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(K, BLOCK_K)):
            k_ok = ks < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            gate = tl.dot(a, g, gate, input_precision=DOT_PRECISION)
            up = tl.dot(a, u, up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if HAS_BIAS:
            b_ptrs = bias_ptr + expert * stride_be + cols
            gate += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptrs + N, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION == "swiglu_oai":
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        else:
            act = gate / (1.0 + tl.exp(-gate)) * up
        out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_weighted_kernel(a_ptr, w_ptr, bias_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr, num_pairs,
                          N, K, stride_am, stride_we, stride_wn, stride_be, stride_om,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[pair, n] = weight[pair] * (a[pair] . w[e, n] (+ bias[e, n])) for this block's pairs of expert e."""
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
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + pair64[:, None] * stride_am + ks[None, :]
        w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(K, BLOCK_K)):
            k_ok = ks < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
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


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, launch: MoeLaunch | None = None, expert_offset: int = 0, *,
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] ([gate | up] rows); down [E, H, I]; topk_weights, topk_ids [T, k]; optional
    biases gate_up_bias [E, 2I], down_bias [E, H]; activation one of reference.EXPERT_ACTIVATIONS. Returns [T, H] in
    x's dtype. Four launches: alignment, gate|up, down, combine.

    This rank holds experts [expert_offset, expert_offset + E) of the ids (global ones under expert parallelism;
    local ones, -1 for another rank's, with the default 0): any other id contributes nothing."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    if gate_up.shape[2] != hidden or tuple(down.shape) != (num_experts, hidden, inter):
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
    launch = launch or launch_policy(num_tokens, top_k, num_experts, hidden, inter)
    sorted_ids, block_expert = align_to_blocks(topk_ids, num_experts, launch.block_m, expert_offset)
    return grouped_experts(x, gate_up, down, topk_weights, topk_ids, sorted_ids, block_expert, launch, expert_offset,
                           gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation,
                           swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, launch: MoeLaunch,
                    expert_offset: int = 0, *, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, activation: str = "silu", swiglu_alpha: float = 1.702,
                    swiglu_limit: float = 7.0) -> torch.Tensor:
    """fused_moe after its alignment (sorted_ids, block_expert from align_to_blocks with launch.block_m): the two
    GEMMs and the combine. Apart so that a benchmark times them without the routing."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    num_pairs = num_tokens * top_k
    num_blocks = block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    t = launch.gate_up
    # Without a bias, the weight stands in for its pointer (never read).
    gate_up_b = gate_up if gate_up_bias is None else gate_up_bias.contiguous()
    _gate_up_act_kernel[(num_blocks * triton.cdiv(inter, t.block_n),)](
        x, gate_up, gate_up_b, act, sorted_ids, block_expert, num_pairs, inter, hidden,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_b.stride(0), act.stride(0),
        float(swiglu_alpha), float(swiglu_limit),
        TOP_K=top_k, BLOCK_M=launch.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT_PRECISION=precision,
        HAS_BIAS=gate_up_bias is not None, ACTIVATION=activation, num_warps=t.num_warps, num_stages=t.num_stages)
    rows = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # the rows of pairs held here
    t = launch.down
    down_b = down if down_bias is None else down_bias.contiguous()
    _down_weighted_kernel[(num_blocks * triton.cdiv(hidden, t.block_n),)](
        act, down, down_b, rows, sorted_ids, block_expert, topk_weights.contiguous(), num_pairs, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), down_b.stride(0), rows.stride(0),
        BLOCK_M=launch.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT_PRECISION=precision,
        HAS_BIAS=down_bias is not None, num_warps=t.num_warps, num_stages=t.num_stages)
    out = torch.empty_like(x)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    _combine_kernel[(num_tokens, triton.cdiv(hidden, launch.combine_block))](
        rows, ids, out, hidden, expert_offset, num_experts, TOP_K=top_k, BLOCK_H=launch.combine_block, num_warps=4)
    return out
