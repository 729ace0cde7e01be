"""DeepSeek V4's manifold-constrained hyper-connections (mHC) in Triton: the pre-mix fused with the norms, and the
post-mix. Definitions: deepseek_v4_reference.mhc_pre / mhc_post (HF's DeepseekV4HyperConnection and the mixing in
DeepseekV4DecoderLayer).

Pre, one program per token: one pass over the N streams' N * D channels computes both the sum of squares and the
(2 + N) * N projections of the raw row (the unweighted RMSNorm is a per-row scale, so it is applied to the N * (N + 2)
sums afterwards instead of to the N * D inputs); then the sigmoid gates, the row softmax and Sinkhorn iterations on
the N x N matrix in registers; then the streams collapsed by the pre gates, and (optionally) the block's input
RMSNorm on the collapsed row, which the program reads back from its output. Post, one program per (token, tile of
channels): every output stream's tile from the block output and the N input streams.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.warmup import CompiledKernel

MAX_STREAMS = 16


@dataclass(frozen=True)
class MhcLaunch:
    streams_pad: int
    block_k: int  # flattened channels per tile of the projection pass
    block_d: int  # channels per tile of the collapse and the norm
    num_warps: int


def launch_policy(hc_mult: int, hidden_size: int) -> MhcLaunch:
    """Pure function of (hc_mult, hidden_size): projection tiles of N_pad**2 (the comb block's fn rows) x block_k
    near 8192 fp32 elements, collapse tiles of N_pad x block_d near 4096; at least 16 channels each."""
    if not 1 <= hc_mult <= MAX_STREAMS:
        raise ValueError(f"hc_mult={hc_mult} must be in [1, {MAX_STREAMS}]")
    if hidden_size < 1:
        raise ValueError(f"hidden_size={hidden_size} must be >= 1")
    n_pad = triton.next_power_of_2(hc_mult)
    rows_pad = n_pad * n_pad  # the comb block's rows, the largest of the three projections
    flat_pad = triton.next_power_of_2(hc_mult * hidden_size)
    block_k = min(flat_pad, max(16, 8192 // rows_pad))
    block_d = min(triton.next_power_of_2(hidden_size), max(16, 4096 // n_pad))
    return MhcLaunch(n_pad, block_k, block_d, num_warps=4)


@triton.jit
def _mhc_pre_kernel(x_ptr, fn_ptr, base_ptr, scale_ptr, norm_ptr, post_ptr, comb_ptr, out_ptr, stride_x, stride_fn,
                    stride_out, hc_eps, rms_eps, N: tl.constexpr, HIDDEN: tl.constexpr, N_PAD: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, SINKHORN_ITERS: tl.constexpr,
                    HAS_NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    n = tl.arange(0, N_PAD)
    n_ok = n < N
    pair_ok = n_ok[:, None] & n_ok[None, :]
    comb_rows = 2 * N + n[:, None] * N + n[None, :]  # fn row of comb[i, j]
    # Pass 1: sum of squares and the projections of the raw flattened row.
    sum_sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    pre_acc = tl.zeros((N_PAD,), dtype=tl.float32)
    post_acc = tl.zeros((N_PAD,), dtype=tl.float32)
    comb_acc = tl.zeros((N_PAD, N_PAD), dtype=tl.float32)
    for k0 in tl.range(0, N * HIDDEN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < N * HIDDEN
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        sum_sq += x * x
        w_pre = tl.load(fn_ptr + n[:, None] * stride_fn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        pre_acc += tl.sum(w_pre.to(tl.float32) * x[None, :], axis=1)
        w_post = tl.load(fn_ptr + (N + n)[:, None] * stride_fn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                         other=0.0)
        post_acc += tl.sum(w_post.to(tl.float32) * x[None, :], axis=1)
        w_comb = tl.load(fn_ptr + comb_rows[:, :, None] * stride_fn + k[None, None, :],
                         mask=pair_ok[:, :, None] & k_ok[None, None, :], other=0.0)
        comb_acc += tl.sum(w_comb.to(tl.float32) * x[None, None, :], axis=2)
    rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / (N * HIDDEN) + rms_eps)
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(pre_acc * rstd * s_pre + tl.load(base_ptr + n, mask=n_ok, other=0.0)) + hc_eps
    post = 2.0 * tl.sigmoid(post_acc * rstd * s_post + tl.load(base_ptr + N + n, mask=n_ok, other=0.0))
    tl.store(post_ptr + row * N + n, post, mask=n_ok)
    logits = comb_acc * rstd * s_comb + tl.load(base_ptr + comb_rows, mask=pair_ok, other=0.0)
    logits = tl.where(pair_ok, logits, float("-inf"))
    e = tl.exp(logits - tl.where(n_ok, tl.max(logits, axis=1), 0.0)[:, None])  # padded rows: all zero
    comb = tl.where(pair_ok, e / tl.where(n_ok, tl.sum(e, axis=1), 1.0)[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in tl.static_range(SINKHORN_ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(comb_ptr + row * N * N + n[:, None] * N + n[None, :], comb, mask=pair_ok)
    # Pass 2: the streams collapsed by the pre gates, rounded to the output's dtype.
    pre = tl.where(n_ok, pre, 0.0)
    out_row = out_ptr + row * stride_out
    dtype = out_ptr.dtype.element_ty
    sum_sq_out = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in tl.range(0, HIDDEN, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < HIDDEN
        xs = tl.load(x_row + n[:, None] * HIDDEN + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        collapsed = tl.sum(pre[:, None] * xs.to(tl.float32), axis=0).to(dtype)
        tl.store(out_row + d, collapsed, mask=d_ok)
        c = collapsed.to(tl.float32)
        sum_sq_out += c * c
    if HAS_NORM:  # pass 3: the block's input RMSNorm, on the row pass 2 stored
        rstd_out = 1.0 / tl.sqrt(tl.sum(sum_sq_out, axis=0) / HIDDEN + rms_eps)
        tl.debug_barrier()
        for d0 in tl.range(0, HIDDEN, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_ok = d < HIDDEN
            c = tl.load(out_row + d, mask=d_ok, other=0.0).to(tl.float32)
            w = tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
            tl.store(out_row + d, (w * (c * rstd_out)).to(dtype), mask=d_ok)


@triton.jit
def _mhc_post_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, stride_y, stride_x, stride_out, N: tl.constexpr,
                     HIDDEN: tl.constexpr, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    # out[t, i] = post[t, i] * y[t] + sum_j comb[t, j, i] * x[t, j], with HF's roundings: post and comb rounded to
    # the streams' dtype, each of the two terms rounded to it, then their sum.
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    n = tl.arange(0, N_PAD)
    n_ok = n < N
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < HIDDEN
    post = tl.load(post_ptr + row * N + n, mask=n_ok, other=0.0).to(dtype).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + d, mask=d_ok, other=0.0).to(tl.float32)
    expanded = (post[:, None] * y[None, :]).to(dtype).to(tl.float32)  # [out stream i, d]
    xs = tl.load(x_ptr + row * stride_x + n[:, None] * HIDDEN + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                 other=0.0).to(tl.float32)  # [in stream j, d]
    comb = tl.load(comb_ptr + row * N * N + n[:, None] * N + n[None, :], mask=n_ok[:, None] & n_ok[None, :],
                   other=0.0).to(dtype).to(tl.float32)  # [j, i]
    mixed = tl.sum(comb[:, :, None] * xs[:, None, :], axis=0).to(dtype).to(tl.float32)  # [i, d]
    tl.store(out_ptr + row * stride_out + n[:, None] * HIDDEN + d[None, :], (expanded + mixed).to(dtype),
             mask=n_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class MhcKey:
    dtype: torch.dtype  # of the streams
    hc_mult: int
    hidden_size: int
    sinkhorn_iters: int
    has_norm: bool
    launch: MhcLaunch


class MhcPre(CompiledKernel):
    """(post, comb, the collapsed and optionally normalized block input) from the streams: see mhc_pre."""
    parallel_compile = True

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def dispatch(self, *, hc_mult: int, hidden_size: int, sinkhorn_iters: int, dtype: torch.dtype,
                 has_norm: bool = True) -> MhcKey:
        if sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters={sinkhorn_iters} must be >= 1")
        return MhcKey(dtype, hc_mult, hidden_size, sinkhorn_iters, has_norm, launch_policy(hc_mult, hidden_size))

    def __call__(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                 hc_eps: float, rms_eps: float, sinkhorn_iters: int, norm_weight: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] (each token's N * D contiguous); fn [(2 + N) * N, N * D], base [(2 + N) * N],
        scale [3] (float32, as HF keeps them); norm_weight [D] float32 or None. Returns post [T, N] float32,
        comb [T, N, N] float32 and the block input [T, D] in streams' dtype."""
        tokens, n, hidden = streams.shape
        if streams.stride(2) != 1 or streams.stride(1) != hidden:
            raise ValueError(f"streams must have each token's [N, D] contiguous, got strides {streams.stride()}")
        m = (2 + n) * n
        if fn.shape != (m, n * hidden) or fn.stride(1) != 1:
            raise ValueError(f"fn must be [{m}, {n * hidden}] with unit stride, got {tuple(fn.shape)}")
        if base.shape != (m,) or scale.shape != (3,) or base.dtype != torch.float32 or scale.dtype != torch.float32:
            raise ValueError(f"base [{m}] and scale [3] must be float32, got {base.dtype} {tuple(base.shape)} and "
                             f"{scale.dtype} {tuple(scale.shape)}")
        if norm_weight is not None and norm_weight.shape != (hidden,):
            raise ValueError(f"norm_weight must be [{hidden}], got {tuple(norm_weight.shape)}")
        key = self.dispatch(hc_mult=n, hidden_size=hidden, sinkhorn_iters=sinkhorn_iters, dtype=streams.dtype,
                            has_norm=norm_weight is not None)
        self.ensure(key)
        post = torch.empty(tokens, n, dtype=torch.float32, device=streams.device)
        comb = torch.empty(tokens, n, n, dtype=torch.float32, device=streams.device)
        out = torch.empty(tokens, hidden, dtype=streams.dtype, device=streams.device)
        if tokens:
            _launch_pre(key, streams, fn, base, scale, norm_weight, post, comb, out, hc_eps, rms_eps, warmup=False)
        return post, comb, out

    def compile(self, key: MhcKey) -> object:
        dev, n, hidden = self.device, key.hc_mult, key.hidden_size
        m = (2 + n) * n
        f32 = dict(dtype=torch.float32, device=dev)
        return _launch_pre(key, torch.empty(1, n, hidden, dtype=key.dtype, device=dev),
                           torch.empty(m, n * hidden, **f32), torch.empty(m, **f32), torch.empty(3, **f32),
                           torch.empty(hidden, **f32) if key.has_norm else None, torch.empty(1, n, **f32),
                           torch.empty(1, n, n, **f32), torch.empty(1, hidden, dtype=key.dtype, device=dev), 1e-6,
                           1e-6, warmup=True)


def _launch_pre(key: MhcKey, streams, fn, base, scale, norm_weight, post, comb, out, hc_eps, rms_eps, warmup: bool):
    launch = key.launch
    args = (streams, fn, base, scale, norm_weight if norm_weight is not None else base, post, comb, out,
            streams.stride(0), fn.stride(0), out.stride(0), hc_eps, rms_eps)
    constexprs = dict(N=key.hc_mult, HIDDEN=key.hidden_size, N_PAD=launch.streams_pad, BLOCK_K=launch.block_k,
                      BLOCK_D=launch.block_d, SINKHORN_ITERS=key.sinkhorn_iters, HAS_NORM=key.has_norm,
                      num_warps=launch.num_warps)
    grid = (streams.shape[0],)
    if warmup:
        return _mhc_pre_kernel.warmup(*args, grid=grid, **constexprs)
    _mhc_pre_kernel[grid](*args, **constexprs)
    return out


def mhc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block (see deepseek_v4_reference.mhc_post): block_out [T, D]; streams [T, N, D] (each
    token's [N, D] contiguous); post [T, N] and comb [T, N, N] from MhcPre. Returns [T, N, D] in streams' dtype.
    Nothing here depends on live values, so there is no variant to warm up beyond the shapes."""
    tokens, n, hidden = streams.shape
    if streams.stride(2) != 1 or streams.stride(1) != hidden or block_out.shape != (tokens, hidden):
        raise ValueError(f"streams [T, N, D] with each token's [N, D] contiguous and block_out [T, D], got "
                         f"{tuple(streams.shape)} strides {streams.stride()} and {tuple(block_out.shape)}")
    if block_out.stride(1) != 1 or post.shape != (tokens, n) or comb.shape != (tokens, n, n):
        raise ValueError(f"post must be [{tokens}, {n}] and comb [{tokens}, {n}, {n}], block_out unit stride")
    launch = launch_policy(n, hidden)
    out = torch.empty(tokens, n, hidden, dtype=streams.dtype, device=streams.device)
    if tokens:
        _mhc_post_kernel[(tokens, triton.cdiv(hidden, launch.block_d))](
            block_out, streams, post.contiguous(), comb.contiguous(), out, block_out.stride(0), streams.stride(0),
            out.stride(0), N=n, HIDDEN=hidden, N_PAD=launch.streams_pad, BLOCK_D=launch.block_d,
            num_warps=launch.num_warps)
    return out
