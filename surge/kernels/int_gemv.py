"""Decode's weight-only int4/int8 GEMV (W4A16, W8A16): y [M, N] = x [M, K] @ W.T for a few rows (M <= MAX_ROWS),
W in the canonical packed layout of surge/kernels/int_packing.py (int32 words along K, unsigned values, group scales,
optional uint8 zero points, optional act-order input_perm), read once with 16-byte loads and dequantized in registers
without one integer-to-float conversion. int4_gemm.int_gemm's tensor-core tiles serve more rows.

Unpacking: the exponent trick. A float32 with exponent field E whose mantissa holds an integer q at bits [p, p + b)
(nothing else) is 2^(E - 127) * (1 + q * 2^(p - 23)); with E = 150 - p that is exactly 2^(23 - p) + q. So value j of
a word, at bits [p, p + b) of its low half (p = b * j) or, after one shift of the word by 16, of its high half, becomes
a float with one AND-OR (`(half & mask_j) | (150 - p) << 23`: a single LOP3, reinterpreted as float32), and q - z
with one subtraction of 2^(23 - p) + z, exact (both in [2^(23 - p), 2^(24 - p)): Sterbenz). Per weight: one LOP3, one
FADD and one FFMA per activation row; per word one shift; no shift, mask or conversion instruction per value beyond
that LOP3 (a shift-mask-I2F unpack costs three, the I2F at a quarter of the FMA rate on Hopper). The 16-bit variant
of the trick (0x4300 | nibble as bf16 = 128 + nibble, two values per packed bf16x2 op) needs inline PTX, which the
CPU interpreter cannot run; float32 lanes give one instruction per value without it, and the float32 products
(x * (q - z), exact integers times x) are accumulated in float32 as the issue asks.

Scales: a word's values share one group (groups are multiples of 32 / bits), so each K step computes, per word
position, dot = sum over the word's values of x * (q - z), and then acc += scale * dot: one FFMA per word. The
accumulator [M, BLOCK_N, CHUNKS, CHUNK_WORDS] is elementwise; it is reduced over K once, at the end.

Tiles: a program owns BLOCK_N output rows and a K range (its split); each step loads a [BLOCK_N, CHUNKS, CHUNK_WORDS]
tile of words, CHUNKS * CHUNK_WORDS contiguous words of each row (16 bytes per thread), each chunk within one group
(one scale and zero per row and chunk). Value j of word w multiplies x[8w + j] (4-bit): each K step loads x in 8
strided slices (from L1: K * 2 bytes shared by every program), each used for the BLOCK_N / (rows of a warp) rows a
thread holds. Act-order reads x[perm[k]] instead. The canonical layout is read as stored, with no repack at load
(int_gemm, the CPU path and the weight cache share it): its one cost is these strided x slices; should the H200
sweep show them binding, a load-time interleave (value j of word w holding K = j * P + w of a P-word block) would make
each slice contiguous, at the price of int_gemm and the CPU dequantization reading that layout too.

Split K (few rows: not enough programs to keep the SMs' loads in flight): each split writes a float32 partial; the
last split of a column block to finish (an arrival counter, reset by it) sums the partials in split order, adds the
bias and writes y: deterministic, and no launch beyond the GEMV's own. The counters are one zeroed int32 buffer per
device, shared by all calls: GEMVs must not run concurrently on two streams (Surge runs its forward on one).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from surge.kernels.int4_gemm import check_int_operands

MAX_ROWS = 4  # the W4A16 methods use this kernel up to here; int_gemm's tensor-core tiles beyond
MAX_M = 16  # the kernel's own limit (registers grow with M)
MAX_SPLIT_K = 8
X_SLICE = 64  # x values of one slice a K step (M padded x words a row): fewer than a program's 128 threads
WORDS_PER_THREAD = 16  # 4 x 16-byte loads per thread per step
H200_SMS = 132
_COUNTERS = 1 << 16  # split-K arrival counters per device (column blocks of one split GEMV)


@dataclass(frozen=True)
class IntGemvLaunch:
    block_n: int  # output rows per program
    chunks: int  # group-aligned chunks per K step
    chunk_words: int  # int32 words of a row per chunk (a power of two; the chunk lies in one group)
    split_k: int = 1  # programs along K; > 1: float32 partials summed by the last split of each column block
    num_warps: int = 4
    num_stages: int = 1  # loads of later K steps issued ahead (Triton's software pipelining)

    @property
    def block_words(self) -> int:
        return self.chunks * self.chunk_words


def chunk_words_for(k: int, group_size: int, bits: int) -> int:
    """The widest chunk (a power of two, at most 16 words = 64 bytes a row) that lies inside one group: any K step
    starts at a multiple of the chunk. Channel-wise (group >= K): 16."""
    per_word = 32 // bits
    if group_size >= k:
        return 16
    if group_size % per_word:
        raise ValueError(f"group_size={group_size} must be a multiple of {per_word} (the values of a {bits}-bit "
                         f"int32 word share one group)")
    words = group_size // per_word
    return min(16, words & -words)


def launch_policy(m: int, n: int, k: int, group_size: int, bits: int = 4, num_sms: int = H200_SMS) -> IntGemvLaunch:
    """Pure function of the shapes (m: a CUDA graph's capture size under graphs). K steps of X_SLICE / M words a
    row (at least 16; fewer for a short K) in group-aligned chunks: an x slice then has fewer values than the program
    has threads, which Triton's layout pass counts as cheap to load straight into the weights' layout (a larger one
    it loads once and redistributes through shared memory, eight times a step). BLOCK_N rows so that each of 4 warps'
    threads holds WORDS_PER_THREAD words a step (at M = 1: 4 rows, each strided x load serving all 4). K split in
    powers of two while the column blocks are fewer than the SMs, each split keeping at least 4 K steps. To be
    confirmed on the H200 by `bench kernels --only int4`'s sweep."""
    for name, value in (("m", m), ("n", n), ("k", k), ("group_size", group_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported: the int GEMV reads 4- or 8-bit weights")
    if m > MAX_M:
        raise ValueError(f"m={m}: the int GEMV takes up to {MAX_M} rows")
    per_word = 32 // bits
    chunk = chunk_words_for(k, group_size, bits)
    m_pad = triton.next_power_of_2(m)
    block_words = max(chunk, min(max(16, X_SLICE // m_pad), triton.next_power_of_2(triton.cdiv(k, per_word))))
    num_warps = 4
    rows = WORDS_PER_THREAD * 32 * num_warps // block_words // m_pad
    block_n = max(1, min(rows, triton.next_power_of_2(n)))
    programs, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_words * per_word)
    split = 1
    while split < MAX_SPLIT_K and programs * split < num_sms and steps >= 8 * split:
        split *= 2
    return IntGemvLaunch(block_n, block_words // chunk, chunk, split, num_warps, num_stages=1)


@cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H200_SMS


_counters: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed split-K counters, made once outside any CUDA graph capture (a graph's memset would zero
    them only when that graph replays); every split GEMV leaves them zero again. None while capturing before they
    exist: that GEMV runs unsplit (same result; the engine's warm-up normally makes them first)."""
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return counters


@triton.jit
def _int_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, perm_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                     M, N, K, k_per_split, stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr,
                     HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
                     CHUNK_WORDS: tl.constexpr, SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """out[m, n] = sum_k x[m, perm[k]] * (u[n, k] - z[n, k // GROUP]) * s[n, k // GROUP] (+ bias[n])."""
    PER_WORD: tl.constexpr = 32 // BITS
    PER_HALF: tl.constexpr = PER_WORD // 2
    CHUNK_K: tl.constexpr = CHUNK_WORDS * PER_WORD
    BLOCK_K: tl.constexpr = CHUNKS * CHUNK_K
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    # 4-D tiles [M_PAD, BLOCK_N, CHUNKS, CHUNK_WORDS]: activation rows, output rows, chunks, words of a chunk.
    rows = tl.arange(0, M_PAD)[:, None, None, None]
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :, None, None]
    chunk_ids = tl.arange(0, CHUNKS)[None, None, :, None]
    word_ids = tl.arange(0, CHUNK_WORDS)[None, None, None, :]
    row_ok, col_ok = rows < M, cols < N
    cols64 = cols.to(tl.int64)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = tl.zeros((M_PAD, BLOCK_N, CHUNKS, CHUNK_WORDS), dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        chunk_k = k0 + chunk_ids * CHUNK_K  # each chunk's first K
        word = chunk_k // PER_WORD + word_ids
        word_ok = word < k_end // PER_WORD  # K % PER_WORD == 0: a word is wholly in or out
        words = tl.load(w_ptr + cols64 * stride_wn + word, mask=col_ok & word_ok, other=0,
                        eviction_policy="evict_first")
        high = words >> 16  # arithmetic: the sign copies land above bit 15, outside every mask below
        group = chunk_k // GROUP
        group_ok = col_ok & (chunk_k < k_end)
        scale = tl.load(scale_ptr + cols64 * stride_sn + group, mask=group_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(zero_ptr + cols64 * stride_zn + group, mask=group_ok, other=0).to(tl.float32)
        else:
            zero = 1 << (BITS - 1)
        dot = tl.zeros((M_PAD, BLOCK_N, CHUNKS, CHUNK_WORDS), dtype=tl.float32)
        for j in tl.static_range(PER_WORD):
            p = (j % PER_HALF) * BITS  # the value's bit position within its half word
            if j < PER_HALF:
                half = words
            else:
                half = high
            magic = (half & (((1 << BITS) - 1) << p)) | ((150 - p) << 23)  # 2^(23 - p) + q as float32 bits
            centered = magic.to(tl.float32, bitcast=True) - (zero + (1 << (23 - p)))  # q - z, exact
            k = word * PER_WORD + j
            if HAS_PERM:
                k = tl.load(perm_ptr + k, mask=word_ok, other=0)
            x = tl.load(x_ptr + rows * stride_xm + k, mask=row_ok & word_ok, other=0.0).to(tl.float32)
            dot += x * centered
        acc += scale * dot
    total = tl.sum(tl.sum(acc, axis=3), axis=2)  # [M_PAD, BLOCK_N]
    out_rows = tl.arange(0, M_PAD)[:, None]
    out_cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    out_mask = (out_rows < M) & (out_cols < N)
    if SPLIT_K > 1:
        tile = out_rows * N + out_cols
        tl.store(partial_ptr + pid_k * M * N + tile, total, mask=out_mask)
        tl.debug_barrier()  # every thread's partial before the (one thread's) release below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last split of this column block: sum all, in split order
            total = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(partial_ptr + split * M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr + pid_n, 0)
            if HAS_BIAS:
                total += tl.load(bias_ptr + out_cols, mask=out_cols < N, other=0.0).to(tl.float32)
            tl.store(out_ptr + out_rows * stride_om + out_cols, total.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        if HAS_BIAS:
            total += tl.load(bias_ptr + out_cols, mask=out_cols < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_rows * stride_om + out_cols, total.to(out_ptr.dtype.element_ty), mask=out_mask)


def int_gemv(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, *, bits: int,
             group_size: int, zero_point: torch.Tensor | None = None, input_perm: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, launch: IntGemvLaunch | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T (+ bias [N]) in x's dtype (bf16, fp16 or fp32) for up to MAX_M rows of x, W in
    the canonical layout (quant_reference.int_gemm is the definition; the arguments are int4_gemm.int_gemm's)."""
    k, n = check_int_operands(x, weight_packed, weight_scale, bits, group_size, zero_point, "int GEMV")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > MAX_M:
        raise ValueError(f"x has {m} rows: the int GEMV takes up to {MAX_M} (int4_gemm.int_gemm serves more)")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    if launch is None:
        launch = launch_policy(m, n, k, group_size, bits, _num_sms(x.device))
    elif launch.chunk_words > chunk_words_for(k, group_size, bits):
        raise ValueError(f"{launch}: chunks of {launch.chunk_words} words straddle groups of {group_size}")
    column_blocks = triton.cdiv(n, launch.block_n)
    if launch.split_k > 1 and column_blocks > _COUNTERS:
        raise ValueError(f"{launch}: {column_blocks} column blocks exceed the {_COUNTERS} split-K counters")
    counters = _arrival_counters(x.device) if launch.split_k > 1 else None
    block_k = launch.block_words * (32 // bits)
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), launch.split_k if counters is not None else 1) * block_k
    split_k = triton.cdiv(k, k_per_split)  # every split non-empty
    if split_k > 1:
        partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    else:
        partial = counters = out  # never read
    weight_packed, weight_scale = weight_packed.contiguous(), weight_scale.contiguous()
    zero = zero_point.contiguous() if zero_point is not None else weight_scale
    perm = input_perm.contiguous() if input_perm is not None else weight_packed
    bias_arg = bias.contiguous() if bias is not None else weight_scale
    _int_gemv_kernel[(column_blocks, split_k)](
        x2, weight_packed, weight_scale, zero, perm, bias_arg, out, partial, counters, m, n, k, k_per_split,
        x2.stride(0), weight_packed.stride(0), weight_scale.stride(0), zero.stride(0), out.stride(0),
        BITS=bits, GROUP=min(group_size, k), HAS_ZERO=zero_point is not None, HAS_PERM=input_perm is not None,
        HAS_BIAS=bias is not None, M_PAD=triton.next_power_of_2(m), BLOCK_N=launch.block_n, CHUNKS=launch.chunks,
        CHUNK_WORDS=launch.chunk_words, SPLIT_K=split_k, NUM_STAGES=launch.num_stages, num_warps=launch.num_warps)
    return out.view(*lead, n)
