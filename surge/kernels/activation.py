"""SiLU-and-mul in Triton: out = silu(x[..., :d]) * x[..., d:], on the merged [gate | up] projection.

As in torch, silu is computed in fp32 and rounded to the input dtype before the product is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class ActivationLaunch:
    block: int
    num_warps: int


def launch_policy(d: int) -> ActivationLaunch:
    """Tiles of up to 1024 outputs per program (8 per thread at 4 warps); smaller rows take one smaller tile."""
    block = min(1024, triton.next_power_of_2(d))
    return ActivationLaunch(block, num_warps=max(1, min(4, block // 256)))


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * d + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] with unit stride on the last dim; returns a new dense [..., d]."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be even: [gate | up]")
    d = x.shape[-1] // 2
    rows2d = x.reshape(-1, 2 * d)  # a view for the model's layouts
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if rows2d.shape[0] == 0 or d == 0:
        return out
    assert rows2d.stride(-1) == 1
    launch = launch_policy(d)
    _silu_and_mul_kernel[(rows2d.shape[0], triton.cdiv(d, launch.block))](
        rows2d, out, rows2d.stride(0), d, BLOCK=launch.block, num_warps=launch.num_warps)
    return out
