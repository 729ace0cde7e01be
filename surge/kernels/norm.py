"""RMSNorm in Triton, optionally fused with the residual add before it: one program per row, the row in registers.

Rounding follows surge.model.layers.norm.RMSNorm step by step (sum rounded to the input dtype, normalised value
rounded to it, then the weight product), so bf16 results differ from torch only through the fp32 mean.
The fp8 variants quantize the rounded output in the same program (per token, or per 1 x group with the M-major
scales torch._scaled_mm takes), bit for bit as rms_norm followed by surge/kernels/fp8_quant.py would.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.quant_reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

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
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
                     rows_inner, stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner, stride_sm, stride_sg,
                     hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr = "none",
                     GROUP: tl.constexpr = 128, QMAX: tl.constexpr = 448.0, MIN_SCALE: tl.constexpr = 1.0,
                     OUT_DTYPE: tl.constexpr = None):
    # Rows may be [outer, inner] with two strides (e.g. q of a fused qkv viewed as [T, H, D]); outputs are dense.
    # QUANT "token" / "group": out is fp8, the output rounded to OUT_DTYPE first, scales at scale_ptr.
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
    if QUANT == "none":
        tl.store(out_ptr + row * hidden + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        y = (normed * w).to(OUT_DTYPE).to(tl.float32)
        if QUANT == "token":
            scale = tl.maximum(tl.div_rn(tl.max(tl.abs(y), 0), QMAX), MIN_SCALE)
            tl.store(scale_ptr + row * stride_sm, scale)
            q = y * tl.div_rn(1.0, scale)
        else:  # groups of GROUP columns: BLOCK is a multiple of GROUP
            groups = tl.reshape(y, (BLOCK // GROUP, GROUP))
            scale = tl.maximum(tl.div_rn(tl.max(tl.abs(groups), 1), QMAX), MIN_SCALE)
            group_ids = tl.arange(0, BLOCK // GROUP)
            tl.store(scale_ptr + row * stride_sm + group_ids * stride_sg, scale,
                     mask=group_ids < tl.cdiv(hidden, GROUP))
            inverse = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
            q = tl.reshape(groups * inverse[:, None], (BLOCK,))
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        tl.store(out_ptr + row * hidden + cols, q.to(out_ptr.dtype.element_ty), mask=mask)


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


def _launch(x, residual, weight, eps, group_size: int | None = None, quant: bool = False):
    """quant: the output fp8 with per-token (group_size None) or 1 x group_size scales, returned third."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    if x.dim() > 3:  # a copy only for layouts the model does not produce
        x = x.reshape(-1, hidden)
        residual = residual.reshape(-1, hidden) if residual is not None else None
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=FP8_DTYPE if quant else out_dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    rows = x.numel() // hidden
    scale = None
    if quant:
        if group_size is None:
            scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        else:  # M-major, as per_token_group_quant_fp8's
            scale = torch.empty(triton.cdiv(hidden, group_size), rows, dtype=torch.float32, device=x.device).t()
    if rows == 0:
        return out, residual_out, scale
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
    quant_args = {}
    if quant:
        if group_size is not None and (group_size < 16 or group_size & (group_size - 1) or group_size > launch.block):
            raise ValueError(f"group_size={group_size} must be a power of two >= 16 and <= the padded hidden size "
                             f"{launch.block}")
        quant_args = dict(QUANT="token" if group_size is None else "group", GROUP=group_size or 128, QMAX=FP8_MAX,
                          MIN_SCALE=FP8_MIN_SCALE, OUT_DTYPE=getattr(tl, str(out_dtype).removeprefix("torch.")))
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, residual_out,
                              scale if scale is not None else out, rows_inner, sxo, sxi, sro, sri,
                              *(scale.stride() if scale is not None else (0, 0)), hidden, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=launch.block, num_warps=launch.num_warps,
                              **quant_args)
    return out, residual_out, scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x ([..., hidden], unit stride on hidden): returns a new dense tensor of dtype
    promote(weight, x), like `RMSNorm.forward(x)`."""
    return _launch(x, None, weight, eps)[0]


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm then fp8 quantization in one pass: x [T, hidden] -> (q float8_e4m3fn [T, hidden], scale float32
    [T, 1] per token, or [T, hidden / group_size] M-major per 1 x group_size): exactly
    fp8_quant.scaled_fp8_quant_per_token / per_token_group_quant_fp8 of rms_norm(x, weight, eps)."""
    out, _, scale = _launch(x, None, weight, eps, group_size, quant=True)
    return out, scale


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), like `RMSNorm.forward(x, residual)`, in one pass."""
    return _launch(x, residual, weight, eps)[:2]


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, x + residual): rms_norm_fp8 of x + residual, and the sum, in one pass."""
    out, residual_out, scale = _launch(x, residual, weight, eps, group_size, quant=True)
    return out, scale, residual_out
