"""Dynamic and static activation quantization to float8_e4m3fn in Triton: per token ([M, 1] scales), per tensor
(a given or a dynamic scale) and per token group (1 x group, the M-major [M, K / group] scale torch._scaled_mm's
blockwise scale_a takes).

Each equals surge/kernels/quant_reference.py bit for bit: amax in float32, scale = max(amax / 448, 1 / (448 * 512))
and its inverse by IEEE division (tl.div_rn), q = saturate(x * inverse) rounded to nearest even.
Memory-bound: one read of x (two for rows longer than a tile), one write of q.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.quant_reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

MAX_ROW_BLOCK = 4096  # columns per step of a per-token row: 16 floats per thread at 8 warps
GROUP_TILE = 2048  # elements per program of the per-group kernel (whole groups)


@dataclass(frozen=True)
class QuantLaunch:
    block: int  # per token: columns per step (a row longer than it takes several); per group: groups per program
    num_warps: int


def per_token_launch(k: int) -> QuantLaunch:
    """One program per row. A row up to MAX_ROW_BLOCK columns is one step (amax and quantization both read it from
    cache); longer rows loop in steps of MAX_ROW_BLOCK."""
    block = min(MAX_ROW_BLOCK, triton.next_power_of_2(max(k, 16)))
    return QuantLaunch(block, num_warps=max(1, min(8, block // 512)))


def per_group_launch(k: int, group_size: int) -> QuantLaunch:
    """Programs of (row, run of whole groups): as many groups as fit GROUP_TILE elements, fewer when the row has
    fewer."""
    groups = triton.cdiv(k, group_size)
    per_program = min(triton.next_power_of_2(groups), max(1, GROUP_TILE // group_size))
    return QuantLaunch(per_program, num_warps=max(1, min(8, per_program * group_size // 256)))


@triton.jit
def _per_token_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, QMAX: tl.constexpr,
                      MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """q[m] = sat(x[m] / s[m]) with s[m] = max(amax |x[m]| / FP8_MAX, MIN_SCALE)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(x_row + start + cols, mask=cols < K - start, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(amax, 0), QMAX), MIN_SCALE)
    inverse = tl.div_rn(1.0, scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        mask = cols < K - start
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x * inverse, -QMAX), QMAX)
        tl.store(q_ptr + row * stride_qm + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _static_kernel(x_ptr, q_ptr, scale_ptr, numel, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    """q = sat(x / scale) over a dense tensor, scale one float32 value."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    inverse = tl.div_rn(1.0, tl.load(scale_ptr))
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(x * inverse, -QMAX), QMAX)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _per_group_kernel(x_ptr, q_ptr, scale_ptr, K, num_groups, stride_xm, stride_qm, stride_sm, stride_sg,
                      QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, GROUP: tl.constexpr,
                      GROUPS_PER_PROGRAM: tl.constexpr):
    """Per-token rules within each group of GROUP columns of row m; the scale of (m, g) at m * stride_sm +
    g * stride_sg (M-major: stride_sm 1)."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 1), QMAX), MIN_SCALE)
    inverse = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    q = tl.minimum(tl.maximum(x * inverse[:, None], -QMAX), QMAX)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < num_groups)


def _check_rows(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with unit stride on K, got shape {tuple(x.shape)} strides "
                         f"{tuple(x.stride())}")


def scaled_fp8_quant_per_token(x: torch.Tensor, launch: QuantLaunch | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, fp16 or fp32; rows may be strided) -> (q float8_e4m3fn [M, K] dense, scale float32 [M, 1]):
    quant_reference.fp8_quant_per_token. The scale is torch._scaled_mm's row-wise scale_a."""
    _check_rows(x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale.fill_(FP8_MIN_SCALE)
    launch = launch or per_token_launch(k)
    _per_token_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), QMAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
                            BLOCK=launch.block, num_warps=launch.num_warps)
    return q, scale


def scaled_fp8_quant_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape) -> (q float8_e4m3fn, scale float32 [1]): with a static scale (one float32 value, e.g. a
    checkpoint's input_scale) one launch; without one the dynamic per-tensor scale (torch's amax, then the same
    launch). quant_reference.fp8_quant_per_tensor."""
    x = x.contiguous()
    if scale is None:
        amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
        scale = (amax / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    if scale.numel() != 1:
        raise ValueError(f"a per-tensor scale has one element, got shape {tuple(scale.shape)}")
    scale = scale.to(device=x.device, dtype=torch.float32).reshape(1)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if x.numel():
        block = 1024
        _static_kernel[(triton.cdiv(x.numel(), block),)](x, q, scale, x.numel(), QMAX=FP8_MAX, BLOCK=block,
                                                        num_warps=4)
    return q, scale


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128, launch: QuantLaunch | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale float32 [M, ceil(K / group_size)] M-major: stride (1, M)), the
    1x128 activation scales of DeepSeek-style block fp8 (quant_reference.fp8_quant_per_token_group). group_size a
    power of two >= 16; K need not be a multiple of it."""
    _check_rows(x)
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size} must be a power of two >= 16")
    m, k = x.shape
    num_groups = triton.cdiv(k, group_size)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_groups, m, dtype=torch.float32, device=x.device).t()
    if m == 0 or k == 0:
        return q, scale
    launch = launch or per_group_launch(k, group_size)
    _per_group_kernel[(m, triton.cdiv(num_groups, launch.block))](
        x, q, scale, k, num_groups, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1), QMAX=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE, GROUP=group_size, GROUPS_PER_PROGRAM=launch.block, num_warps=launch.num_warps)
    return q, scale
