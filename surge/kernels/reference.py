"""Plain-torch definitions of what the fused kernels compute (RMSNorm, rotate-half rotary, mixture of experts, the
FP8 KV cache's quantization): the CPU path of the layers and the attention prologue, and the reference the Triton
kernels are tested against. No Triton here."""
from __future__ import annotations

from collections.abc import Callable

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn  # what an FP8 KV cache stores (vLLM's fp8 / fp8_e4m3)
FP8_MAX = 448.0  # its largest finite value: quantized values saturate there


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float32, saturated to +-FP8_MAX, rounded to the nearest float8_e4m3fn (ties to even): what the
    cache-write kernels store. scale: a float32 scalar tensor (per-tensor)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a stored float8 value stands for: x * scale (in float32), in `dtype`."""
    return (x.float() * scale).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, computed in float32, returned in x's dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's "rotate half" rotary layout; cos/sin broadcast over the heads, half the head size each."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotary layout: channel pairs (2i, 2i + 1) rotated by frequency i; cos/sin as in `rotate_half`."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    return rotate_interleaved(x, cos, sin) if interleaved else rotate_half(x, cos, sin)


EXPERT_ACTIVATIONS = ("silu", "swiglu_oai", "silu_clamped")


def expert_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", alpha: float = 1.702,
                      limit: float = 7.0) -> torch.Tensor:
    """An expert's gated activation. silu: silu(gate) * up. swiglu_oai (gpt-oss): gate clamped from above at limit,
    up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). silu_clamped (DeepSeek V4): the same clamps,
    then silu(gate) * up."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "swiglu_oai":
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if activation == "silu_clamped":
        return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    raise ValueError(f"activation={activation!r} is not supported; supported: {', '.join(EXPERT_ACTIVATIONS)}")


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None, activation: str = "silu", swiglu_alpha: float = 1.702,
              swiglu_limit: float = 7.0,
              activation_quant: Callable[[torch.Tensor, str], torch.Tensor] | None = None) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert(x[t]), expert e being down[e] @ act(gate, up) + down_bias[e] with
    [gate | up] = gate_up[e] @ x + gate_up_bias[e] (biases optional; act: `expert_activation`); ids of -1 (experts
    held by another rank) contribute nothing.

    x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; gate_up_bias [E, 2I]; down_bias [E, H]; topk_* [T, k]. Rounded as
    HF transformers' experts loop: each projection in x's dtype, experts added in ascending order.

    activation_quant (optional, (rows, "gate_up" | "down") -> rows): applied to each expert's input rows and to its
    activation before the down projection; a quantize-dequantize that makes this the definition of the kernels'
    quantized variants."""
    linear = torch.nn.functional.linear
    out = torch.zeros_like(x)
    inter = down.shape[-1]
    for expert in topk_ids.unique().tolist():
        if expert < 0:
            continue
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        rows = x[token] if activation_quant is None else activation_quant(x[token], "gate_up")
        gate_up_e = linear(rows, gate_up[expert])
        if gate_up_bias is not None:
            gate_up_e = gate_up_e + gate_up_bias[expert]
        gate, up = gate_up_e.split(inter, dim=-1)
        act = expert_activation(gate, up, activation, swiglu_alpha, swiglu_limit)
        y = linear(act if activation_quant is None else activation_quant(act, "down"), down[expert])
        if down_bias is not None:
            y = y + down_bias[expert]
        out.index_add_(0, token, y * topk_weights[token, slot, None])
    return out


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [P], expert of each block [P / block_m]): pair p = token * k + slot, grouped by expert in
    ascending order (a stable sort), each group padded to whole blocks with the id num_pairs; blocks past the last
    group (and pairs of expert -1) have expert -1. P = ceil((num_pairs + E * (block_m - 1)) / block_m) * block_m,
    the most any routing needs. Device ops only, no host sync."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs, device = flat.numel(), flat.device
    padded_rows = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    bucket = torch.where(flat < 0, num_experts, flat)  # remote experts sort last, into a bucket no block reads
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    group_start = padded_end - padded
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    rank_in_group = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_bucket]
    row = torch.where(sorted_bucket < num_experts, group_start[sorted_bucket] + rank_in_group, padded_rows)
    sorted_ids = torch.full((padded_rows + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, row, order.to(torch.int32))
    block_start = torch.arange(0, padded_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end[:num_experts], block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids[:padded_rows], block_expert
