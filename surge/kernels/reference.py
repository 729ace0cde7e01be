"""Plain-torch definitions of what the fused kernels compute (RMSNorm, rotate-half rotary, mixture of experts): the
CPU path of the layers and the attention prologue, and the reference the Triton kernels are tested against. No Triton
here."""
from __future__ import annotations

import torch


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


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert(x[t]), expert e being down[e] @ (silu(gate) * up) with
    [gate | up] = gate_up[e] @ x; ids of -1 (experts held by another rank) contribute nothing.

    x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_* [T, k]. Rounded as HF transformers' experts loop: each
    projection in x's dtype, experts added in ascending order."""
    out = torch.zeros_like(x)
    inter = down.shape[-1]
    for expert in topk_ids.unique().tolist():
        if expert < 0:
            continue
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = torch.nn.functional.linear(x[token], gate_up[expert]).split(inter, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[expert])
        out.index_add_(0, token, y * topk_weights[token, slot, None])
    return out
