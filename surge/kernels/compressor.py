"""DeepSeek V4's compressor pooling in Triton: each closed window of `rate` tokens becomes one compressed KV entry
(HF's DeepseekV4HCACompressor at rate 128, DeepseekV4CSACompressor and the indexer's compressor at rate 4 with the
overlapping two-series windows), written into a paged cache at its slot. The definition, rounding included, is
deepseek_v4_reference.compress_windows.

Tokens' kv_proj / gate_proj rows live in a paged state cache (state_kv, state_gate [blocks, block_size, W], one row
per token position, its own block table), so a window closes whichever step its last token comes in: the partial
window is just state rows not pooled yet. One program per entry to emit: pass 1 pools tiles of channels (softmax
over the window's slots per channel), storing the pooled row, rounded to the cache's dtype as HF rounds it, at the
entry's slot; pass 2 reads the row back, RMS-normalizes it and turns its rotary channels (interleaved pairs at
position window * rate). Entries come as a fixed-capacity list (seq, window, slot); slot -1 skips, so a CUDA graph
captured for the capacity replays any number of closing windows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.kernels.warmup import CompiledKernel

MAX_HEAD_DIM = 1024  # pass 2 holds the entry's row in registers
TILE_ELEMENTS = 4096  # pass 1: window slots x channels per tile


@dataclass(frozen=True)
class CompressLaunch:
    slots_pad: int  # window slots: rate, or 2 * rate with overlap, padded
    block_d: int  # channels per pass-1 tile
    head_dim_pad: int
    half_rope_pad: int
    num_warps: int


def launch_policy(rate: int, head_dim: int, rope_dim: int, overlap: bool) -> CompressLaunch:
    """Pure function of the compressor's shape: pass-1 tiles of about TILE_ELEMENTS (all slots, as many channels
    as fit, at least 16), pass 2 the whole row."""
    if rate < 1:
        raise ValueError(f"rate={rate} must be >= 1")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} must be in [1, {MAX_HEAD_DIM}]")
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ValueError(f"rope_dim={rope_dim} must be even and in (0, head_dim={head_dim}]")
    slots_pad = triton.next_power_of_2(rate * (2 if overlap else 1))
    dim_pad = triton.next_power_of_2(head_dim)
    block_d = min(dim_pad, max(16, TILE_ELEMENTS // slots_pad))
    return CompressLaunch(slots_pad, block_d, dim_pad, triton.next_power_of_2(rope_dim // 2),
                          num_warps=4 if dim_pad <= 512 else 8)


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x rounded to DTYPE and back: a step HF does in the cache's dtype."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _compress_kernel(kv_ptr, gate_ptr, table_ptr, bias_ptr, norm_ptr, cos_ptr, sin_ptr, seq_ptr, window_ptr,
                     slot_ptr, out_ptr, stride_sb, stride_ss, stride_bt, stride_bias, stride_cos, stride_out, eps,
                     RATE: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, OVERLAP: tl.constexpr,
                     STATE_BLOCK: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr, HALF_ROPE_PAD: tl.constexpr):
    entry = tl.program_id(0)
    slot_out = tl.load(slot_ptr + entry).to(tl.int64)
    if slot_out >= 0:
        seq = tl.load(seq_ptr + entry).to(tl.int64)
        window = tl.load(window_ptr + entry).to(tl.int64)
        dtype = out_ptr.dtype.element_ty
        out_row = out_ptr + slot_out * stride_out
        # Slot j: with overlap, j < RATE is token j of window - 1, read in its first half (Ca), and j >= RATE token
        # j - RATE of this window, in its second half (Cb); else token j of this window. Bias row: j mod RATE.
        j = tl.arange(0, SLOTS_PAD)
        if OVERLAP:
            first = j < RATE
            pos_in = tl.where(first, j, j - RATE)
            token = tl.where(first, window - 1, window) * RATE + pos_in
            half = tl.where(first, 0, HEAD_DIM)
            present = (j < 2 * RATE) & ((j >= RATE) | (window >= 1))
        else:
            pos_in = j
            token = window * RATE + j
            half = tl.zeros_like(j)
            present = j < RATE
        token = tl.maximum(token, 0)
        block = tl.load(table_ptr + seq * stride_bt + token // STATE_BLOCK, mask=present, other=0).to(tl.int64)
        row = block * stride_sb + (token % STATE_BLOCK) * stride_ss + half  # channel offset of the slot's series
        bias_row = pos_in * stride_bias + half
        sum_sq = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask = present[:, None] & (d < HEAD_DIM)[None, :]
            kv = tl.load(kv_ptr + row[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
            logit = tl.load(gate_ptr + row[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
            logit += tl.load(bias_ptr + bias_row[:, None] + d[None, :], mask=mask, other=0.0)
            logit = tl.where(mask, logit, float("-inf"))
            e = tl.exp(logit - tl.max(logit, axis=0)[None, :])
            weight = _round(e / tl.sum(e, axis=0)[None, :], dtype)
            pooled = _round(tl.sum(_round(kv * weight, dtype), axis=0), dtype)
            tl.store(out_row + d, pooled.to(dtype), mask=d < HEAD_DIM)
            sum_sq += tl.where(d < HEAD_DIM, pooled * pooled, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / HEAD_DIM + eps)
        tl.debug_barrier()  # pass 2 reads what other threads of the program stored
        # Pass 2: RMSNorm, then the rotary pairs (2i, 2i + 1) of the trailing ROPE_DIM channels at window * RATE.
        d = tl.arange(0, HEAD_DIM_PAD)
        nope = d < HEAD_DIM - ROPE_DIM
        x = tl.load(out_row + d, mask=nope, other=0.0).to(tl.float32)
        w = tl.load(norm_ptr + d, mask=nope, other=0.0)
        tl.store(out_row + d, (w * (x * rstd)).to(dtype), mask=nope)
        i = tl.arange(0, HALF_ROPE_PAD)
        pair_ok = i < ROPE_DIM // 2
        even = HEAD_DIM - ROPE_DIM + 2 * i
        xe = _round(tl.load(norm_ptr + even, mask=pair_ok, other=0.0)
                    * (tl.load(out_row + even, mask=pair_ok, other=0.0).to(tl.float32) * rstd), dtype)
        xo = _round(tl.load(norm_ptr + even + 1, mask=pair_ok, other=0.0)
                    * (tl.load(out_row + even + 1, mask=pair_ok, other=0.0).to(tl.float32) * rstd), dtype)
        position = window * RATE
        # The tables rounded to the cache's dtype, as HF rounds them (identity when they come in that dtype).
        cos = _round(tl.load(cos_ptr + position * stride_cos + i, mask=pair_ok, other=0.0).to(tl.float32), dtype)
        sin = _round(tl.load(sin_ptr + position * stride_cos + i, mask=pair_ok, other=0.0).to(tl.float32), dtype)
        tl.debug_barrier()  # every read of the row is done before it is overwritten
        tl.store(out_row + even, (xe * cos - xo * sin).to(dtype), mask=pair_ok)
        tl.store(out_row + even + 1, (xo * cos + xe * sin).to(dtype), mask=pair_ok)


@dataclass(frozen=True)
class CompressKey:
    dtype: torch.dtype  # of the state rows and the cache
    rate: int
    head_dim: int
    rope_dim: int
    overlap: bool
    state_block: int
    launch: CompressLaunch


class CompressorPool(CompiledKernel):
    """Pools the closing windows named by (entry_seq, entry_window, entry_slot) into `cache`."""
    parallel_compile = True

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def dispatch(self, *, rate: int, head_dim: int, rope_dim: int, overlap: bool, state_block: int,
                 dtype: torch.dtype) -> CompressKey:
        return CompressKey(dtype, rate, head_dim, rope_dim, overlap, state_block,
                           launch_policy(rate, head_dim, rope_dim, overlap))

    def __call__(self, state_kv: torch.Tensor, state_gate: torch.Tensor, state_block_table: torch.Tensor,
                 position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor, entry_seq: torch.Tensor, entry_window: torch.Tensor,
                 entry_slot: torch.Tensor, cache: torch.Tensor, *, rate: int, overlap: bool) -> None:
        """state_kv, state_gate [blocks, block_size, W] (W = D, or 2D with overlap), rows by token position
        through state_block_table [seqs, max_blocks] int32; position_bias [rate, W] and norm_weight [D] float32;
        cos_cache, sin_cache [max_positions, rope_dim / 2] (the compress rope: float32, the model's tables, or
        already in the state's dtype; either way rounded to it, as HF rounds them);
        entry_seq, entry_window [E] int32 and entry_slot [E] int64 (-1: skip); cache [blocks, block_size, D] of
        the state's dtype, written at the entries' slots."""
        width = state_kv.shape[-1]
        head_dim = width // 2 if overlap else width
        rope_dim = 2 * cos_cache.shape[-1]
        if state_gate.shape != state_kv.shape or state_gate.stride() != state_kv.stride():
            raise ValueError(f"state_gate {tuple(state_gate.shape)} must match state_kv {tuple(state_kv.shape)}")
        if state_kv.stride(-1) != 1 or cache.stride(-1) != 1:
            raise ValueError("state_kv, state_gate and cache must have unit stride on channels")
        if cache.dim() != 3 or cache.shape[-1] != head_dim or cache.dtype != state_kv.dtype:
            raise ValueError(f"cache must be [blocks, block_size, {head_dim}] of {state_kv.dtype}, got "
                             f"{cache.dtype} {tuple(cache.shape)}")
        if cache.stride(0) != cache.shape[1] * cache.stride(1):
            raise ValueError("cache blocks must be contiguous in slots (slot = block * block_size + offset)")
        if position_bias.shape != (rate, width) or position_bias.dtype != torch.float32:
            raise ValueError(f"position_bias must be float32 [{rate}, {width}], got {position_bias.dtype} "
                             f"{tuple(position_bias.shape)}")
        if norm_weight.shape != (head_dim,) or norm_weight.dtype != torch.float32:
            raise ValueError(f"norm_weight must be float32 [{head_dim}], got {norm_weight.dtype} "
                             f"{tuple(norm_weight.shape)}")
        same_layout = sin_cache.shape == cos_cache.shape and sin_cache.stride() == cos_cache.stride()
        if not same_layout or cos_cache.stride(-1) != 1:
            raise ValueError("cos_cache and sin_cache must have one shape and layout, unit stride last")
        for name, t, dtype in (("state_block_table", state_block_table, torch.int32),
                               ("entry_seq", entry_seq, torch.int32), ("entry_window", entry_window, torch.int32),
                               ("entry_slot", entry_slot, torch.int64)):
            if t.dtype != dtype:
                raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
        key = self.dispatch(rate=rate, head_dim=head_dim, rope_dim=rope_dim, overlap=overlap,
                            state_block=state_kv.shape[1], dtype=state_kv.dtype)
        self.ensure(key)
        if entry_slot.numel():
            _launch(key, state_kv, state_gate, state_block_table, position_bias, norm_weight, eps, cos_cache,
                    sin_cache, entry_seq, entry_window, entry_slot, cache, warmup=False)

    def compile(self, key: CompressKey) -> object:
        dev = self.device
        width = key.head_dim * (2 if key.overlap else 1)
        state = torch.empty(1, key.state_block, width, dtype=key.dtype, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        rope = torch.empty(1, key.rope_dim // 2, dtype=torch.float32, device=dev)  # the model's float32 tables
        return _launch(key, state, state, torch.zeros(1, 1, **i32), torch.empty(key.rate, width, device=dev),
                       torch.empty(key.head_dim, device=dev), 1e-6, rope, rope, torch.zeros(1, **i32),
                       torch.zeros(1, **i32), torch.full((1,), -1, dtype=torch.int64, device=dev),
                       torch.empty(1, 1, key.head_dim, dtype=key.dtype, device=dev), warmup=True)


def _launch(key: CompressKey, state_kv, state_gate, table, bias, norm_weight, eps, cos, sin, entry_seq, entry_window,
            entry_slot, cache, warmup: bool):
    launch = key.launch
    args = (state_kv, state_gate, table, bias, norm_weight, cos, sin, entry_seq, entry_window, entry_slot, cache,
            state_kv.stride(0), state_kv.stride(1), table.stride(0), bias.stride(0), cos.stride(0), cache.stride(1), eps)
    constexprs = dict(RATE=key.rate, HEAD_DIM=key.head_dim, ROPE_DIM=key.rope_dim, OVERLAP=key.overlap,
                      STATE_BLOCK=key.state_block, SLOTS_PAD=launch.slots_pad, BLOCK_D=launch.block_d,
                      HEAD_DIM_PAD=launch.head_dim_pad, HALF_ROPE_PAD=launch.half_rope_pad,
                      num_warps=launch.num_warps)
    grid = (entry_slot.shape[0],)
    if warmup:
        return _compress_kernel.warmup(*args, grid=grid, **constexprs)
    _compress_kernel[grid](*args, **constexprs)
    return cache
