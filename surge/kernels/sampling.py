"""Greedy, top-k and top-p sampling in Triton, one program per row, exact against `sample_reference`: the CUDA
Sampler's kernel for rows without min-p (surge/model/layers/sampler.py), drawing from noise it is given."""
# Ordering is total: float32 values map to int32 keys (NaN above +inf, -0 equal to +0) and ties go to the lower index.
# Top-k keeps every value >= the k-th largest (ties with it kept, as in HF). Top-p keeps the shortest prefix of the
# total order whose mass before each element stays below p, with masses in fixed point (exp(x - max) * 2**bits,
# floored, summed as int64) so no sum depends on summation order. The draw is the exponential race argmax(e / q):
# q ~ Exp(1) comes in as a tensor, so the RNG stays in torch (seeded requests keep their generators) and the kernel
# is deterministic. Thresholds are found by binary search over the keys, each probe a pass over what may hold the
# survivors: the row in registers when it fits one tile; else each lane's 4 largest, kept in registers by one pass
# over the row, whenever they provably hold every survivor (the fast path: top-k up to LANE_TOP_MAX_K, top-p whose
# nucleus they hold); else the candidates (elements of positive fixed-point weight, and for top-p above a floor the
# lanes prove) compacted into per-row scratch; else the row.
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from surge.kernels.warmup import CompiledKernel

SINGLE_TILE_MAX = 16384  # vocab sizes up to this keep the whole row in registers
CHUNK = 2048  # tile of the chunked path: its lanes' top 4 (keys, indices, weights) stay in registers
LANE_TOP_MAX_K = 256  # top-k rows up to this k try the lanes' top 4 first (2048 lanes rarely hold 5 of the top 256)
# Chunked path: scratch for compacted candidates, 3 int32 (key, index, weight) per slot, CHUNK lanes per row; slots
# per lane fill this budget for max_batch rows, between MIN_SLOTS and MAX_SLOTS.
CANDIDATE_BUDGET = 64 << 20
MIN_SLOTS, MAX_SLOTS = 4, 64
P_BITS = 24  # top_p in fixed point: floor(p * 2**24), as many bits as a float32 significand
_MASS_BITS = 62  # total mass * 2**P_BITS must stay below 2**63

# Triton's interpreter has no libdevice; its tl.exp is numpy's, which the CPU reference also uses.
_ACCURATE_EXP = tl.constexpr(not triton.knobs.runtime.interpret)
_KEY_FLOOR = tl.constexpr(-2147483647)  # below every key (key(-inf) = -2139095041)
_KEY_NAN = tl.constexpr(2147483647)
_KEY_POS_INF = tl.constexpr(2139095040)
_KEY_NEG_INF = tl.constexpr(-2139095041)
_TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal: a draw of q = 0 counts as this


@dataclass(frozen=True)
class SamplingLaunch:
    block: int  # vocab elements per tile
    num_chunks: int  # tiles per row
    single_tile: bool  # the row is loaded once and every pass runs on registers
    candidate_slots: int  # chunked path: per-lane slots the searches compact candidates into (0: none)
    num_warps: int
    num_stages: int
    weight_bits: int  # fixed-point bits of exp(x - max) in top-p masses
    top_k: bool  # the top-k search is compiled in (max_k > 0)
    lane_top: bool = False  # chunked path: each lane's 4 largest kept in registers and searched first


def launch_policy(max_batch: int, vocab_size: int, max_k: int) -> SamplingLaunch:
    """Pure function of capacities: the largest batch (a CUDA graph's capture size), the vocabulary, the largest
    top-k any row may ask for (0: none). Live k, p and lengths never enter it."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be >= 1")
    if not 1 <= vocab_size < 2 ** 31:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, 2**31)")
    if not 0 <= max_k <= vocab_size:
        raise ValueError(f"max_k={max_k} must be in [0, vocab_size={vocab_size}]")
    weight_bits = min(20, _MASS_BITS - P_BITS - (vocab_size - 1).bit_length())
    if weight_bits < 8:
        raise ValueError(f"vocab_size={vocab_size} is too large for exact fixed-point top-p masses")
    padded = triton.next_power_of_2(vocab_size)
    if padded <= SINGLE_TILE_MAX:
        # Between 8 and 32 elements per thread: fewer wastes warps, more runs out of registers.
        return SamplingLaunch(padded, 1, True, 0, num_warps=min(16, max(4, padded // 512)), num_stages=1,
                              weight_bits=weight_bits, top_k=max_k > 0)
    slots = min(MAX_SLOTS, max(MIN_SLOTS, CANDIDATE_BUDGET // (max_batch * 3 * 4 * CHUNK)))
    # 16 warps at any batch: 4 elements of each register vector per thread fit 128 registers without spilling
    # (ptxas, sm_90a), one row per SM; 8 warps need about 230, also one row per SM, with half the warps.
    return SamplingLaunch(CHUNK, triton.cdiv(vocab_size, CHUNK), False, slots, num_warps=16, num_stages=2,
                          weight_bits=weight_bits, top_k=max_k > 0, lane_top=True)


@triton.jit
def _exp(x):
    if _ACCURATE_EXP:
        return libdevice.exp(x)  # correctly rounded to within an ulp, as torch.exp on CUDA
    else:
        return tl.exp(x)


@triton.jit
def _order_key(x):
    """int32 keys that order float32 totally: NaN highest, then +inf ... -inf; -0 and +0 equal."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    return tl.where(x != x, _KEY_NAN, key)


@triton.jit
def _tile(row_ptr, chunk, temperature, greedy, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """Values of one tile (logits / temperature, or raw logits for a greedy row), their keys, in-range mask."""
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = offs < VOCAB
    raw = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.where(greedy, raw, tl.math.div_rn(raw, tl.where(greedy, 1.0, temperature)))
    return x, _order_key(x), valid, offs


@triton.jit
def _key_value(key):
    """The float32 a key stands for (+0 for the zeros, a NaN for the NaN key): enough to recompute a weight."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _weight(x, key, valid, m, m_key, m_finite):
    """exp(x - max) with the limits made explicit: elements equal to the max weigh 1; with an infinite or NaN max
    everything else weighs 0."""
    e = tl.where(key == m_key, 1.0, tl.where(m_finite, _exp(x - tl.where(m_finite, m, 0.0)), 0.0))
    return tl.where(valid, e, 0.0)


@triton.jit
def _fixed_weight(x, key, valid, m, m_key, m_finite, WEIGHT_BITS: tl.constexpr):
    return (_weight(x, key, valid, m, m_key, m_finite) * ((1 << WEIGHT_BITS) * 1.0)).to(tl.int64)


@triton.jit
def _block(j, from_candidates, row_ptr, cand_ptr, lane_count, temperature, greedy, m, m_key, m_finite, key0, w0, offs0,
           NEED_WEIGHT: tl.constexpr, SINGLE_TILE: tl.constexpr, VOCAB: tl.constexpr, BLOCK: tl.constexpr,
           SLOTS: tl.constexpr, WEIGHT_BITS: tl.constexpr):
    """Keys (_KEY_FLOOR where empty), fixed-point weights and vocabulary indices of block j of what a pass visits:
    the row held in registers, tile j of the row, or slot j of every lane's compacted candidates."""
    if SINGLE_TILE:
        key, w, offs = key0, w0, offs0
    else:
        if from_candidates:
            slot = cand_ptr + j * BLOCK + tl.arange(0, BLOCK)
            filled = j < lane_count
            key = tl.load(slot, mask=filled, other=_KEY_FLOOR)
            offs = tl.load(slot + SLOTS * BLOCK, mask=filled, other=VOCAB)
            w = tl.load(slot + 2 * SLOTS * BLOCK, mask=filled, other=0).to(tl.int64)
        else:
            x, key, valid, offs = _tile(row_ptr, j, temperature, greedy, VOCAB, BLOCK)
            key = tl.where(valid, key, _KEY_FLOOR)
            if NEED_WEIGHT:
                w = _fixed_weight(x, key, valid, m, m_key, m_finite, WEIGHT_BITS)
            else:
                w = tl.zeros([BLOCK], tl.int64)
    return key, w, offs


# Passes stream blocks into per-lane accumulators and reduce once at the end: no reductions (barriers) per block.

@triton.jit
def _count_at_least(t, n_blocks, from_candidates, row_ptr, cand_ptr, lane_count, temperature, greedy, m, m_key,
                    m_finite, key0, w0, offs0, SINGLE_TILE: tl.constexpr, VOCAB: tl.constexpr, BLOCK: tl.constexpr,
                    SLOTS: tl.constexpr, WEIGHT_BITS: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.int32)
    for j in range(0, n_blocks):
        key, w, offs = _block(j, from_candidates, row_ptr, cand_ptr, lane_count, temperature, greedy, m, m_key,
                              m_finite, key0, w0, offs0, False, SINGLE_TILE, VOCAB, BLOCK, SLOTS, WEIGHT_BITS)
        acc += (key >= t).to(tl.int32)
    return tl.sum(acc, 0)


@triton.jit
def _mass(above, tied, before, n_blocks, from_candidates, row_ptr, cand_ptr, lane_count, temperature, greedy, m,
          m_key, m_finite, key0, w0, offs0, SINGLE_TILE: tl.constexpr, VOCAB: tl.constexpr, BLOCK: tl.constexpr,
          SLOTS: tl.constexpr, WEIGHT_BITS: tl.constexpr):
    """Fixed-point mass of the elements with key > above, plus those with key == tied and index < before."""
    acc = tl.zeros([BLOCK], tl.int64)
    for j in range(0, n_blocks):
        key, w, offs = _block(j, from_candidates, row_ptr, cand_ptr, lane_count, temperature, greedy, m, m_key,
                              m_finite, key0, w0, offs0, True, SINGLE_TILE, VOCAB, BLOCK, SLOTS, WEIGHT_BITS)
        acc += tl.where((key > above) | ((key == tied) & (offs < before)), w, 0)
    return tl.sum(acc, 0)


# ---- the fast path: each lane's 4 largest in registers ----
# Lane l sees elements l, l + BLOCK, ...; every element a lane did not keep is <= its 4th, so once the search's
# threshold lies above every such 4th (of lanes that saw more than 4), the kept ones hold everything that matters.
# Raw keys order as x = raw / temperature does (division by t > 0 rounds monotonically), so the pass needs no
# division; keys are recomputed for x on the 4 * BLOCK kept elements only.

@triton.jit
def _insert4(key, idx, k0, i0, k1, i1, k2, i2, k3, i3):
    """Insert into the descending (k0 >= k1 >= k2 >= k3) lists; strict comparisons keep the earlier of equals."""
    g0 = key > k0
    g1 = key > k1
    g2 = key > k2
    g3 = key > k3
    k3, i3 = tl.where(g2, k2, tl.where(g3, key, k3)), tl.where(g2, i2, tl.where(g3, idx, i3))
    k2, i2 = tl.where(g1, k1, tl.where(g2, key, k2)), tl.where(g1, i1, tl.where(g2, idx, i2))
    k1, i1 = tl.where(g0, k0, tl.where(g1, key, k1)), tl.where(g0, i0, tl.where(g1, idx, i1))
    k0, i0 = tl.where(g0, key, k0), tl.where(g0, idx, i0)
    return k0, i0, k1, i1, k2, i2, k3, i3


@triton.jit
def _raw_tile(row_ptr, chunk, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = offs < VOCAB
    raw = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    return tl.where(valid, _order_key(raw), _KEY_FLOOR), valid, offs


@triton.jit
def _lane_top4(row_ptr, VOCAB: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    """One pass over the row: each lane's 4 largest raw keys with their indices, and its smallest key."""
    k0 = tl.full([BLOCK], _KEY_FLOOR, tl.int32)
    k1, k2, k3 = k0, k0, k0
    i0 = tl.full([BLOCK], VOCAB, tl.int32)
    i1, i2, i3 = i0, i0, i0
    lane_min = tl.full([BLOCK], _KEY_NAN, tl.int32)
    for c in range(0, NUM_CHUNKS, 2):  # two tiles in flight per step
        key_a, valid_a, offs_a = _raw_tile(row_ptr, c, VOCAB, BLOCK)
        key_b, valid_b, offs_b = _raw_tile(row_ptr, c + 1, VOCAB, BLOCK)
        lane_min = tl.minimum(lane_min, tl.minimum(tl.where(valid_a, key_a, _KEY_NAN),
                                                   tl.where(valid_b, key_b, _KEY_NAN)))
        k0, i0, k1, i1, k2, i2, k3, i3 = _insert4(key_a, offs_a, k0, i0, k1, i1, k2, i2, k3, i3)
        k0, i0, k1, i1, k2, i2, k3, i3 = _insert4(key_b, offs_b, k0, i0, k1, i1, k2, i2, k3, i3)
    return k0, i0, k1, i1, k2, i2, k3, i3, lane_min


@triton.jit
def _x_key(raw_key, temperature):
    """The key of raw / temperature, from the key of raw."""
    return _order_key(tl.math.div_rn(_key_value(raw_key), temperature))


@triton.jit
def _lanes_count_at_least(t, k0, k1, k2, k3):
    return tl.sum((k0 >= t).to(tl.int32) + (k1 >= t).to(tl.int32) + (k2 >= t).to(tl.int32) + (k3 >= t).to(tl.int32), 0)


@triton.jit
def _lanes_mass(above, tied, before, k0, i0, w0, k1, i1, w1, k2, i2, w2, k3, i3, w3):
    """_mass over the kept elements; weights are int32 (at most 2**20), four of them still fit one."""
    acc = tl.where((k0 > above) | ((k0 == tied) & (i0 < before)), w0, 0)
    acc += tl.where((k1 > above) | ((k1 == tied) & (i1 < before)), w1, 0)
    acc += tl.where((k2 > above) | ((k2 == tied) & (i2 < before)), w2, 0)
    acc += tl.where((k3 > above) | ((k3 == tied) & (i3 < before)), w3, 0)
    return tl.sum(acc.to(tl.int64), 0)


@triton.jit
def _lane_weight(key, idx, c_k, m, m_key, m_finite, VOCAB: tl.constexpr, WEIGHT_BITS: tl.constexpr):
    """Fixed-point weight of a kept element that survives top-k (key >= c_k), else 0."""
    w = _fixed_weight(_key_value(key), key, (idx < VOCAB) & (key >= c_k), m, m_key, m_finite, WEIGHT_BITS)
    return w.to(tl.int32)


@triton.jit
def _lane_score(key, idx, t0, idx_cut, noise_row, m, m_key, m_finite):
    keep = (key > t0) | ((key == t0) & (idx <= idx_cut))
    q = tl.maximum(tl.load(noise_row + idx, mask=keep, other=1.0), _TINY)
    e = _weight(_key_value(key), key, keep, m, m_key, m_finite)
    return tl.where(keep, _order_key(tl.math.div_rn(e, q)), _KEY_FLOOR)


@triton.jit
def _sample_lanes(top_k, top_p, k_active, p_active, row_total, noise_row, m, m_key, m_finite, min_key,
                  k0, i0, k1, i1, k2, i2, k3, i3, VOCAB: tl.constexpr, BLOCK: tl.constexpr,
                  WEIGHT_BITS: tl.constexpr, P_SCALE_BITS: tl.constexpr):
    """The same cuts as the general path, searched over the kept elements (x keys). Returns (done, token, floor):
    done is False when some element outside them could survive, and the row then takes the general path, which
    needs to look at no element with key <= floor (top-p alone: the kept ones above it already make the bar)."""
    has_more = 4 * BLOCK + tl.arange(0, BLOCK) < VOCAB  # lanes that saw more than they kept
    outside = tl.max(tl.where(has_more, k3, _KEY_FLOOR), 0).to(tl.int64)  # no element outside is above this
    done = k_active | p_active
    floor = tl.full([], _KEY_FLOOR, tl.int32)
    c_k = min_key.to(tl.int64)
    if k_active:
        lo = min_key.to(tl.int64)
        hi = m_key.to(tl.int64) + 1
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            ok = _lanes_count_at_least(mid.to(tl.int32), k0, k1, k2, k3) >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        c_k = lo
        done = outside < c_k
    w0 = _lane_weight(k0, i0, c_k, m, m_key, m_finite, VOCAB, WEIGHT_BITS)
    w1 = _lane_weight(k1, i1, c_k, m, m_key, m_finite, VOCAB, WEIGHT_BITS)
    w2 = _lane_weight(k2, i2, c_k, m, m_key, m_finite, VOCAB, WEIGHT_BITS)
    w3 = _lane_weight(k3, i3, c_k, m, m_key, m_finite, VOCAB, WEIGHT_BITS)

    t0 = c_k - 1
    idx_cut = -1
    if p_active & done:
        p_fixed = tl.maximum((top_p * (1 << P_SCALE_BITS)).to(tl.int64), 1)
        # The bar comes from the exact total: the top-k survivors' (all kept), or the row's (top-p alone).
        lo = c_k - 1
        mass_lo = _lanes_mass(lo.to(tl.int32), _KEY_FLOOR, 0, k0, i0, w0, k1, i1, w1, k2, i2, w2, k3, i3, w3)
        total = tl.where(k_active, mass_lo, row_total)
        bar = p_fixed * total
        # Kept masses never exceed the row's, and equal them above `outside`: the cut found among the kept ones is
        # the row's whenever it lies above `outside`.
        done = (mass_lo << P_SCALE_BITS) >= bar
        mass_hi = tl.full([], 0, tl.int64)
        if done:
            hi = m_key.to(tl.int64)
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                mass = _lanes_mass(mid.to(tl.int32), _KEY_FLOOR, 0, k0, i0, w0, k1, i1, w1, k2, i2, w2, k3, i3, w3)
                ok = (mass << P_SCALE_BITS) < bar
                hi = tl.where(ok, mid, hi)
                mass_hi = tl.where(ok, mass, mass_hi)
                lo = tl.where(ok, lo, mid)
                mass_lo = tl.where(ok, mass_lo, mass)
            t0 = hi
            floor = (t0 - 1).to(tl.int32)  # the kept ones above it make the bar, so the row's cut lies above too
            done = t0 > outside
        if done:
            t0_key = t0.to(tl.int32)
            w_t0 = _fixed_weight(_key_value(t0_key), t0_key, True, m, m_key, m_finite, WEIGHT_BITS)
            idx_cut = VOCAB
            if ((mass_lo - w_t0) << P_SCALE_BITS) >= bar:
                lo_i = 0
                hi_i = VOCAB
                while hi_i - lo_i > 1:
                    mid_i = lo_i + (hi_i - lo_i) // 2
                    mass = _lanes_mass(_KEY_NAN, t0_key, mid_i, k0, i0, w0, k1, i1, w1, k2, i2, w2, k3, i3, w3)
                    ok = ((mass_hi + mass) << P_SCALE_BITS) < bar
                    lo_i = tl.where(ok, mid_i, lo_i)
                    hi_i = tl.where(ok, hi_i, mid_i)
                idx_cut = lo_i

    s0 = _lane_score(k0, i0, t0, idx_cut, noise_row, m, m_key, m_finite)
    s1 = _lane_score(k1, i1, t0, idx_cut, noise_row, m, m_key, m_finite)
    s2 = _lane_score(k2, i2, t0, idx_cut, noise_row, m, m_key, m_finite)
    s3 = _lane_score(k3, i3, t0, idx_cut, noise_row, m, m_key, m_finite)
    best = tl.max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), 0)
    token = tl.minimum(tl.minimum(tl.where(s0 == best, i0, VOCAB), tl.where(s1 == best, i1, VOCAB)),
                       tl.minimum(tl.where(s2 == best, i2, VOCAB), tl.where(s3 == best, i3, VOCAB)))
    return done, tl.min(token, 0), floor


@triton.jit
def _sample_kernel(logits_ptr, noise_ptr, temperature_ptr, top_k_ptr, top_p_ptr, out_ptr, candidates_ptr,
                   stride_logits, stride_noise,
                   VOCAB: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, SINGLE_TILE: tl.constexpr,
                   SLOTS: tl.constexpr, WEIGHT_BITS: tl.constexpr, TOP_K: tl.constexpr, LANE_TOP: tl.constexpr,
                   LANE_TOP_K: tl.constexpr, P_SCALE_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits
    noise_row = noise_ptr + row * stride_noise
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    if TOP_K:
        k_active = (top_k > 0) & (top_k < VOCAB)
    else:  # compiled out
        k_active = top_k != top_k
    p_active = top_p < 1.0
    lane = tl.arange(0, BLOCK)
    if SINGLE_TILE:
        x0, key0, valid0, offs0 = _tile(row_ptr, 0, temperature, greedy, VOCAB, BLOCK)
        key0 = tl.where(valid0, key0, _KEY_FLOOR)
    else:  # placeholders, never read
        key0 = tl.zeros([BLOCK], tl.int32)
        offs0 = lane

    # Pass 1: the maximum key (first index among equals) and the minimum key; on the fast path also each lane's
    # 4 largest (x keys; k0 is the lane's maximum).
    lane_max = tl.full([BLOCK], _KEY_FLOOR, tl.int32)
    lane_idx = tl.full([BLOCK], VOCAB, tl.int32)
    lane_min = tl.full([BLOCK], _KEY_NAN, tl.int32)
    k1, k2, k3 = lane_max, lane_max, lane_max
    i1, i2, i3 = lane_idx, lane_idx, lane_idx
    use_lanes = False
    if LANE_TOP:
        use_lanes = (temperature > 0.0) & ((k_active & (top_k <= LANE_TOP_K)) | (p_active & ~k_active))
    if use_lanes:
        k0, lane_idx, k1, i1, k2, i2, k3, i3, raw_min = _lane_top4(row_ptr, VOCAB, BLOCK, NUM_CHUNKS)
        lane_max = tl.where(lane_idx < VOCAB, _x_key(k0, temperature), _KEY_FLOOR)
        k1 = tl.where(i1 < VOCAB, _x_key(k1, temperature), _KEY_FLOOR)
        k2 = tl.where(i2 < VOCAB, _x_key(k2, temperature), _KEY_FLOOR)
        k3 = tl.where(i3 < VOCAB, _x_key(k3, temperature), _KEY_FLOOR)
        lane_min = _x_key(raw_min, temperature)  # a lane with no element keeps the NaN key, above every minimum
    else:
        for c in range(NUM_CHUNKS):
            if SINGLE_TILE:
                key, valid, offs = key0, valid0, offs0
            else:
                x, key, valid, offs = _tile(row_ptr, c, temperature, greedy, VOCAB, BLOCK)
                key = tl.where(valid, key, _KEY_FLOOR)
            better = key > lane_max  # strict: each lane keeps its first (lowest-index) maximum
            lane_idx = tl.where(better, offs, lane_idx)
            lane_max = tl.where(better, key, lane_max)
            lane_min = tl.minimum(lane_min, tl.where(valid, key, _KEY_NAN))
    m_key = tl.max(lane_max, 0)
    m_idx = tl.min(tl.where(lane_max == m_key, lane_idx, VOCAB), 0)
    if greedy:
        tl.store(out_ptr + row, m_idx.to(tl.int64))
        return
    min_key = tl.min(lane_min, 0)
    m = _key_value(m_key)
    m_finite = (m_key > _KEY_NEG_INF) & (m_key < _KEY_POS_INF)
    if SINGLE_TILE:
        w0 = _fixed_weight(x0, key0, valid0, m, m_key, m_finite, WEIGHT_BITS)
    else:
        w0 = tl.zeros([BLOCK], tl.int64)
    lane_count = tl.zeros([BLOCK], tl.int32)

    row_total = tl.full([], 0, tl.int64)
    floor = tl.full([], _KEY_FLOOR, tl.int32)
    if use_lanes:
        if p_active & ~k_active:  # top-p alone needs the whole row's mass: one more pass
            row_total = _mass(min_key - 1, _KEY_FLOOR, 0, NUM_CHUNKS, False, row_ptr, candidates_ptr, lane_count,
                              temperature, greedy, m, m_key, m_finite, key0, w0, offs0, SINGLE_TILE, VOCAB, BLOCK,
                              SLOTS, WEIGHT_BITS)
        done, token, floor = _sample_lanes(top_k, top_p, k_active, p_active, row_total, noise_row, m, m_key, m_finite,
                                    min_key, lane_max, lane_idx, k1, i1, k2, i2, k3, i3, VOCAB, BLOCK, WEIGHT_BITS,
                                    P_SCALE_BITS)
        if done:
            tl.store(out_ptr + row, token.to(tl.int64))
            return

    # Pass 2 (chunked rows under top-k/top-p): compact the candidates, elements of positive fixed-point weight (and
    # above the floor the lanes found), into SLOTS slots per lane. Every top-p survivor is one (the rest add no mass
    # and come after them in the order), and so is every top-k survivor when there are at least k. When a lane
    # overflows, the passes visit the row.
    cand_ptr = candidates_ptr + row * (3 * SLOTS * BLOCK)
    from_candidates = top_k != top_k  # False
    n_blocks = tl.full([], NUM_CHUNKS, tl.int32)
    n_cand = tl.full([], VOCAB, tl.int32)
    if not SINGLE_TILE:
        if k_active | p_active:
            for c in range(NUM_CHUNKS):
                x, key, valid, offs = _tile(row_ptr, c, temperature, greedy, VOCAB, BLOCK)
                w = _fixed_weight(x, key, valid, m, m_key, m_finite, WEIGHT_BITS)
                is_cand = (w > 0) & (key > floor)
                fits = is_cand & (lane_count < SLOTS)
                slot = cand_ptr + lane_count * BLOCK + lane
                tl.store(slot, key, mask=fits)
                tl.store(slot + SLOTS * BLOCK, offs, mask=fits)
                tl.store(slot + 2 * SLOTS * BLOCK, w.to(tl.int32), mask=fits)
                lane_count += is_cand.to(tl.int32)
            most = tl.max(lane_count, 0)
            total_cand = tl.sum(lane_count, 0)
            from_candidates = (most <= SLOTS) & (p_active | (top_k <= total_cand))
            n_blocks = tl.where(from_candidates, most, NUM_CHUNKS)
            n_cand = tl.where(from_candidates, total_cand, VOCAB)

    # Top-k: the k-th largest key, c_k = max{t : #(key >= t) >= k}; everything >= c_k stays (ties included). With
    # fewer candidates than k (only under top-p) every candidate is above the cut.
    c_k = min_key.to(tl.int64)
    if k_active & (top_k <= n_cand):
        lo = min_key.to(tl.int64)
        hi = m_key.to(tl.int64) + 1
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            ok = _count_at_least(mid, n_blocks, from_candidates, row_ptr, cand_ptr, lane_count, temperature, greedy,
                                 m, m_key, m_finite, key0, w0, offs0, SINGLE_TILE, VOCAB, BLOCK, SLOTS,
                                 WEIGHT_BITS) >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        c_k = lo

    # Top-p over the top-k survivors. Survivors are "key > t0, or key == t0 and index <= idx_cut": t0 is the
    # smallest key whose strictly-greater mass is below the bar (p_fixed * total / 2**P); among elements tied at
    # t0, index order decides, each kept while the mass before it is still below the bar.
    t0 = c_k - 1
    idx_cut = -1
    if p_active:
        p_fixed = tl.maximum((top_p * (1 << P_SCALE_BITS)).to(tl.int64), 1)
        total = row_total  # candidates above a floor: the row's mass came from a pass over it
        if floor == _KEY_FLOOR:
            total = _mass(c_k - 1, _KEY_FLOOR, 0, n_blocks, from_candidates, row_ptr, cand_ptr, lane_count,
                          temperature, greedy, m, m_key, m_finite, key0, w0, offs0, SINGLE_TILE, VOCAB, BLOCK, SLOTS,
                          WEIGHT_BITS)
        bar = p_fixed * total
        # Below the floor a probe sees only the mass above it, which already misses the bar, as the row's does: the
        # same decision.
        lo = c_k - 1  # invariant: mass(key > lo) misses the bar, mass(key > hi) makes it
        hi = m_key.to(tl.int64)
        mass_lo = total
        mass_hi = tl.full([], 0, tl.int64)
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            mass = _mass(mid, _KEY_FLOOR, 0, n_blocks, from_candidates, row_ptr, cand_ptr, lane_count, temperature,
                         greedy, m, m_key, m_finite, key0, w0, offs0, SINGLE_TILE, VOCAB, BLOCK, SLOTS, WEIGHT_BITS)
            ok = (mass << P_SCALE_BITS) < bar
            hi = tl.where(ok, mid, hi)
            mass_hi = tl.where(ok, mass, mass_hi)
            lo = tl.where(ok, lo, mid)
            mass_lo = tl.where(ok, mass_lo, mass)
        t0 = hi
        # All elements tied at t0 stay unless the last one's mass before (mass_lo minus its own weight) fails the
        # bar; only then search the index cut (the first tied element always stays: mass_hi makes the bar).
        t0_key = t0.to(tl.int32)
        w_t0 = _fixed_weight(_key_value(t0_key), t0_key, True, m, m_key, m_finite, WEIGHT_BITS)
        idx_cut = VOCAB
        if ((mass_lo - w_t0) << P_SCALE_BITS) >= bar:
            lo_i = 0  # the largest index b whose tied mass before it keeps the mass under the bar
            hi_i = VOCAB
            while hi_i - lo_i > 1:
                mid_i = lo_i + (hi_i - lo_i) // 2
                mass = _mass(_KEY_NAN, t0_key, mid_i, n_blocks, from_candidates, row_ptr, cand_ptr, lane_count,
                             temperature, greedy, m, m_key, m_finite, key0, w0, offs0, SINGLE_TILE, VOCAB, BLOCK,
                             SLOTS, WEIGHT_BITS)
                ok = ((mass_hi + mass) << P_SCALE_BITS) < bar
                lo_i = tl.where(ok, mid_i, lo_i)
                hi_i = tl.where(ok, hi_i, mid_i)
            idx_cut = lo_i

    # Last pass: the exponential race among survivors, ties to the lower index. Noise is read for survivors only.
    lane_best = tl.full([BLOCK], _KEY_FLOOR, tl.int32)
    lane_idx = tl.full([BLOCK], VOCAB, tl.int32)
    for j in range(0, n_blocks):
        key, w, offs = _block(j, from_candidates, row_ptr, cand_ptr, lane_count, temperature, greedy, m, m_key,
                              m_finite, key0, w0, offs0, False, SINGLE_TILE, VOCAB, BLOCK, SLOTS, WEIGHT_BITS)
        keep = (key > t0) | ((key == t0) & (offs <= idx_cut))
        q = tl.maximum(tl.load(noise_row + offs, mask=keep, other=1.0), _TINY)
        e = _weight(_key_value(key), key, keep, m, m_key, m_finite)
        score = tl.where(keep, _order_key(tl.math.div_rn(e, q)), _KEY_FLOOR)
        better = score > lane_best  # lanes visit their elements in index order: strict keeps the first
        lane_idx = tl.where(better, offs, lane_idx)
        lane_best = tl.where(better, score, lane_best)
    best = tl.max(lane_best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(lane_best == best, lane_idx, VOCAB), 0).to(tl.int64))


@dataclass(frozen=True)
class SamplingKey:
    dtype: torch.dtype  # of the logits
    vocab_size: int
    launch: SamplingLaunch


class TopKTopPSampler(CompiledKernel):
    """Rows without penalties, min_p or logprobs: temperature (0 = greedy), top-k (<= 0 or >= V: off), top-p
    (>= 1: off) per row, and the exponential race on caller-supplied noise."""
    parallel_compile = True

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def dispatch(self, *, max_batch: int, vocab_size: int, max_k: int, dtype: torch.dtype) -> SamplingKey:
        return SamplingKey(dtype, vocab_size, launch_policy(max_batch, vocab_size, max_k))

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 noise: torch.Tensor, *, max_batch: int, max_k: int, out: torch.Tensor | None = None,
                 launch: SamplingLaunch | None = None) -> torch.Tensor:
        """logits [n, V] (fp32/bf16/fp16, unit stride on V); temperature [n] fp32; top_k [n] int32; top_p [n] fp32;
        noise [n, V] fp32 with q > 0 (ignored for greedy rows). Returns [n] int64. `launch` overrides the policy
        (tests: geometry alone must never change a token)."""
        n, vocab_size = logits.shape
        key = self.dispatch(max_batch=max_batch, vocab_size=vocab_size, max_k=max_k, dtype=logits.dtype)
        if launch is not None:
            key = SamplingKey(logits.dtype, vocab_size, launch)
        if n > max_batch:
            raise ValueError(f"{n} rows exceed max_batch={max_batch}, the capacity the launch was chosen for")
        self.ensure(key)
        if out is None:
            out = torch.empty(n, dtype=torch.int64, device=logits.device)
        if n:
            _launch(key, logits, temperature, top_k, top_p, noise, out, warmup=False)
        return out

    def compile(self, key: SamplingKey) -> object:
        dev, v = self.device, key.vocab_size
        return _launch(key, torch.empty(1, v, dtype=key.dtype, device=dev), torch.ones(1, device=dev),
                       torch.zeros(1, dtype=torch.int32, device=dev), torch.ones(1, device=dev),
                       torch.ones(1, v, device=dev), torch.empty(1, dtype=torch.int64, device=dev), warmup=True)


def _launch(key: SamplingKey, logits, temperature, top_k, top_p, noise, out, warmup: bool):
    launch = key.launch
    assert logits.stride(-1) == 1 and noise.stride(-1) == 1 and noise.shape == logits.shape
    assert top_k.dtype == torch.int32 and temperature.dtype == torch.float32 and top_p.dtype == torch.float32
    # Scratch for the compacted candidates: rewritten before it is read in every launch, so nothing carries over
    # between launches or CUDA graph replays.
    candidates = torch.empty((logits.shape[0], 3, launch.candidate_slots, launch.block) if launch.candidate_slots
                             else (1,), dtype=torch.int32, device=logits.device)
    args = (logits, noise, temperature, top_k, top_p, out, candidates, logits.stride(0), noise.stride(0))
    constexprs = dict(VOCAB=key.vocab_size, BLOCK=launch.block, NUM_CHUNKS=launch.num_chunks,
                      SINGLE_TILE=launch.single_tile, SLOTS=launch.candidate_slots, WEIGHT_BITS=launch.weight_bits,
                      TOP_K=launch.top_k, LANE_TOP=launch.lane_top, LANE_TOP_K=LANE_TOP_MAX_K,
                      P_SCALE_BITS=P_BITS, num_warps=launch.num_warps, num_stages=launch.num_stages)
    if warmup:
        return _sample_kernel.warmup(*args, grid=(logits.shape[0],), **constexprs)
    _sample_kernel[(logits.shape[0],)](*args, **constexprs)
    return out


# ---- the reference: the same semantics by sorting, in torch (numpy's exp on the CPU, as the interpreter) ----

def order_key(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 keys of the total order (NaN highest, -0 == +0)."""
    bits = x.float().contiguous().view(torch.int32)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = torch.where(x == 0, torch.zeros_like(key), key)
    return torch.where(x.isnan(), torch.full_like(key, 2 ** 31 - 1), key)


def _reference_exp(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return torch.exp(x)
    return torch.from_numpy(np.exp(x.numpy()))


def _argmax_first(key: torch.Tensor) -> int:
    return int(torch.nonzero(key == key.max())[0, 0])


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     noise: torch.Tensor, weight_bits: int) -> torch.Tensor:
    """Row by row, by a stable sort of the keys: what the kernel computes by binary search."""
    out = []
    vocab = logits.shape[1]
    for i in range(logits.shape[0]):
        raw = logits[i].float()
        t = temperature[i].float()
        if float(t) == 0.0:
            out.append(_argmax_first(order_key(raw)))
            continue
        x = raw / t
        key = order_key(x)
        order = torch.sort(key, descending=True, stable=True).indices
        m_key = int(key[order[0]])
        m = x[order[0]]
        finite = -2139095041 < m_key < 2139095040
        e = torch.where(key == m_key, torch.ones_like(x), _reference_exp(x - m) if finite else torch.zeros_like(x))
        keep = torch.ones(vocab, dtype=torch.bool, device=x.device)
        k = int(top_k[i])
        if 0 < k < vocab:
            keep &= key >= key[order[k - 1]]
        p = top_p[i].float()
        if float(p) < 1.0:
            p_fixed = max(int((p * 2 ** P_BITS).to(torch.int64)), 1)
            w = torch.where(keep, (e * 2.0 ** weight_bits).to(torch.int64), 0)[order]
            before = torch.cumsum(w, 0) - w
            keep_sorted = keep[order] & ((before << P_BITS) < p_fixed * int(w.sum()))
            keep = torch.zeros_like(keep).scatter_(0, order, keep_sorted)
        q = noise[i].float().clamp_min(torch.finfo(torch.float32).tiny)  # as the kernel: q = 0 counts as tiny
        score = torch.where(keep, order_key(e / q), torch.full_like(key, -2 ** 31 + 1))
        out.append(_argmax_first(score))
    return torch.tensor(out, dtype=torch.int64, device=logits.device)
