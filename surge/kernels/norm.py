"""RMSNorm in Triton, optionally fused with the residual add before it: one program per row, the row in registers.

Rounding follows surge.model.layers.norm.RMSNorm step by step (sum rounded to the input dtype, normalised value
rounded to it, then the weight product), so bf16 results differ from torch only through the fp32 mean.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 65536  # one row per program, in registers


@dataclass(frozen=True)
class NormLaunch:
    block: int
    num_warps: int


def launch_policy(hidden_size: int) -> NormLaunch:
    """One tile spans the row; a warp per 512 elements (16 per thread), between 1 and 16 warps."""
    if not 1 <= hidden_size <= MAX_HIDDEN:
        raise ValueError(f"hidden_size={hidden_size} is out of range: the Triton RMSNorm handles 1..{MAX_HIDDEN}")
    block = triton.next_power_of_2(hidden_size)
    return NormLaunch(block, num_warps=min(16, max(1, block // 512)))


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     rows_inner, stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
                     hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # Rows may be [outer, inner] with two strides (e.g. q of a fused qkv viewed as [T, H, D]); outputs are dense.
    row = tl.program_id(0).to(tl.int64)
    outer = row // rows_inner
    inner = row % rows_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[int, int, int]:
    """(rows_inner, stride_outer, stride_inner) addressing t's rows; last dim must have unit stride."""
    if t.stride(-1) != 1:
        raise ValueError(f"the last dimension must be contiguous, got strides {tuple(t.stride())}")
    if t.dim() == 1:
        return 1, 0, 0
    if t.dim() == 2:
        return 1, t.stride(0), 0
    assert t.dim() == 3, t.shape
    return t.shape[1], t.stride(0), t.stride(1)


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    if x.dim() > 3:  # a copy only for layouts the model does not produce
        x = x.reshape(-1, hidden)
        residual = residual.reshape(-1, hidden) if residual is not None else None
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    rows = x.numel() // hidden
    if rows == 0:
        return out, residual_out
    rows_inner, sxo, sxi = _row_layout(x)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype}")
        r_inner, sro, sri = _row_layout(residual)
        assert r_inner == rows_inner
    else:
        sro = sri = 0
    launch = launch_policy(hidden)
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, residual_out,
                              rows_inner, sxo, sxi, sro, sri, hidden, eps, HAS_RESIDUAL=residual is not None,
                              BLOCK=launch.block, num_warps=launch.num_warps)
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x ([..., hidden], unit stride on hidden): returns a new dense tensor of dtype
    promote(weight, x), like `RMSNorm.forward(x)`."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), like `RMSNorm.forward(x, residual)`, in one pass."""
    return _launch(x, residual, weight, eps)
