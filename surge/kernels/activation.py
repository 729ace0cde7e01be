"""SiLU-and-mul in Triton: out = silu(x[..., :d]) * x[..., d:], on the merged [gate | up] projection.

As in torch, silu is computed in fp32 and rounded to the input dtype before the product is. The fp8 variant quantizes
the rounded product in the same launch (per token, or per 1 x group with M-major scales), bit for bit as
silu_and_mul followed by surge/kernels/fp8_quant.py would.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.quant_reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE


@dataclass(frozen=True)
class ActivationLaunch:
    block: int
    num_warps: int


MAX_ROW_TILE = 16384  # per-token fp8: outputs of a row held in registers at once (32 per thread at 16 warps)


def launch_policy(d: int) -> ActivationLaunch:
    """Tiles of up to 1024 outputs per program (8 per thread at 4 warps); smaller rows take one smaller tile."""
    block = min(1024, triton.next_power_of_2(d))
    return ActivationLaunch(block, num_warps=max(1, min(4, block // 256)))


def per_token_fp8_launch(d: int) -> ActivationLaunch:
    """silu_and_mul_fp8 per token: one program per row, which needs the row's amax before it quantizes. A row of up
    to MAX_ROW_TILE outputs is one tile, read once and kept in registers (Qwen3-8B's 12288: 16 warps); a longer row
    takes launch_policy's tiles twice (the amax, then the product recomputed), a serial walk that at decode's few
    rows would leave the device idle."""
    if d > MAX_ROW_TILE:
        return launch_policy(d)
    block = triton.next_power_of_2(max(d, 16))
    return ActivationLaunch(block, num_warps=max(1, min(16, block // 1024)))


@triton.jit
def _silu_mul(x_row, d, cols, mask):
    """silu(gate) * up at cols of one row, rounded to the input dtype (returned in it)."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    tl.store(out_ptr + row * d + cols, _silu_mul(x_ptr + row * stride_x, d, cols, mask), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_x, d, stride_sm, stride_sg, QMAX: tl.constexpr,
                             MIN_SCALE: tl.constexpr, PER_TOKEN: tl.constexpr, GROUP: tl.constexpr,
                             BLOCK: tl.constexpr, ONE_TILE: tl.constexpr):
    """Per token: one program per row, the row one tile in registers (ONE_TILE: BLOCK >= d) or two passes over its
    tiles (the row's amax, then the product recomputed and quantized). Per group: programs of (row, BLOCK columns:
    BLOCK / GROUP whole groups)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if PER_TOKEN and ONE_TILE:
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        y = _silu_mul(x_row, d, cols, mask).to(tl.float32)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(y), 0), QMAX), MIN_SCALE)
        tl.store(scale_ptr + row * stride_sm, scale)
        q = tl.minimum(tl.maximum(y * tl.div_rn(1.0, scale), -QMAX), QMAX)
        tl.store(q_ptr + row * d + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    elif PER_TOKEN:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, d, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_silu_mul(x_row, d, cols, cols < d).to(tl.float32)))
        scale = tl.maximum(tl.div_rn(tl.max(amax, 0), QMAX), MIN_SCALE)
        tl.store(scale_ptr + row * stride_sm, scale)
        inverse = tl.div_rn(1.0, scale)
        for start in range(0, d, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < d
            q = tl.minimum(tl.maximum(_silu_mul(x_row, d, cols, mask).to(tl.float32) * inverse, -QMAX), QMAX)
            tl.store(q_ptr + row * d + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        groups = tl.reshape(_silu_mul(x_row, d, cols, mask).to(tl.float32), (BLOCK // GROUP, GROUP))
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(groups), 1), QMAX), MIN_SCALE)
        group_ids = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
        tl.store(scale_ptr + row * stride_sm + group_ids * stride_sg, scale, mask=group_ids < tl.cdiv(d, GROUP))
        inverse = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        q = tl.reshape(tl.minimum(tl.maximum(groups * inverse[:, None], -QMAX), QMAX), (BLOCK,))
        tl.store(q_ptr + row * d + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


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


def silu_and_mul_fp8(x: torch.Tensor, group_size: int | None = None, launch: ActivationLaunch | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2 * d] -> (q float8_e4m3fn [T, d], scale float32 [T, 1] per token, or [T, d / group_size] M-major per
    1 x group_size): exactly fp8_quant's per-token / per-group quantization of silu_and_mul(x), in one launch."""
    if x.dim() != 2 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, 2 * d] ([gate | up]) with unit stride, got {tuple(x.shape)}")
    rows, d = x.shape[0], x.shape[1] // 2
    launch = launch or (per_token_fp8_launch(d) if group_size is None else launch_policy(d))
    if group_size is not None and (group_size < 16 or group_size & (group_size - 1) or group_size > launch.block):
        raise ValueError(f"group_size={group_size} must be a power of two >= 16 and <= the tile ({launch.block})")
    q = torch.empty(rows, d, dtype=FP8_DTYPE, device=x.device)
    if group_size is None:
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    else:  # M-major, as per_token_group_quant_fp8's
        scale = torch.empty(triton.cdiv(d, group_size), rows, dtype=torch.float32, device=x.device).t()
    if rows == 0 or d == 0:
        return q, scale
    grid = (rows,) if group_size is None else (rows, triton.cdiv(d, launch.block))
    _silu_and_mul_fp8_kernel[grid](x, q, scale, x.stride(0), d, scale.stride(0), scale.stride(1), QMAX=FP8_MAX,
                                   MIN_SCALE=FP8_MIN_SCALE, PER_TOKEN=group_size is None, GROUP=group_size or 128,
                                   BLOCK=launch.block, ONE_TILE=group_size is None and launch.block >= d,
                                   num_warps=launch.num_warps)
    return q, scale
