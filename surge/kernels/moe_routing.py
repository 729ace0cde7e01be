"""Routing of a fused mixture of experts on the GPU, in few launches: the router (softmax, top-k, renormalization in
one kernel) and the block alignment of the (token, expert) pairs (one launch for a decode step, two beyond).

Both replace chains of small torch ops (topk's sorts, cumsum, searchsorted, scatter, ...) that cost more than the
expert GEMMs at batch 1. Decode-sized batches skip the alignment altogether: fused_moe's pair path reads the router's
ids and weights as they are, so a decode step routes in this one router launch. Static shapes, no host sync: a CUDA
graph replays any routing. Their definitions are the torch code in surge/model/layers/moe.py (select_experts) and
surge/kernels/reference.py (align_to_blocks). The router's variants are ROUTER's keys (a CompiledKernel); the
alignment's are part of fused_moe's (FUSED_MOE), both compiled by the engine's kernel warm-up.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from surge.kernels.warmup import CompiledKernel, compile_only, triton_int_class
from surge.kernels.warmup import launch as launch_kernel

# Elements of a [pairs, experts] one-hot tile (and of a [blocks, experts] comparison): about 64 int32 per thread of
# four warps, so the tiles stay in registers.
_TILE_ELEMENTS = 8192
# Up to this many one-hot steps (256 pairs of 128 experts: 32 tokens of top 8) one program aligns in one launch;
# beyond, the two-launch path's programs, each of which reads every program's counts, so their number is capped
# and each takes a longer chunk of pairs instead.
MAX_ONE_PROGRAM_STEPS, MAX_ALIGN_PROGRAMS = 4, 64
ROUTER_ONE_WARP_ELEMENTS = 256


@dataclass(frozen=True)
class RouterLaunch:
    rows: int  # token rows per program
    experts_pad: int  # the experts' power-of-two lane count
    top_k_pad: int
    num_warps: int = 4


def router_launch(num_tokens: int, num_experts: int, top_k: int) -> RouterLaunch:
    """Pure function of shapes (the token count is a graph's capture size under graphs): one row per program up to
    16 rows, then as many rows as fit a tile, so a prefill does not launch a program per token."""
    for name, value in (("num_tokens", num_tokens), ("num_experts", num_experts), ("top_k", top_k)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be <= num_experts={num_experts}")
    experts_pad = triton.next_power_of_2(num_experts)
    rows = 1 if num_tokens <= 16 else min(triton.next_power_of_2(num_tokens), max(1, 2048 // experts_pad))
    # A tile of up to ROUTER_ONE_WARP_ELEMENTS (a decode row of 128 or 256 experts) in one warp: its reductions
    # over the experts (three per chosen expert) are then register shuffles, without the shared-memory round trips
    # and barriers that four warps need for each.
    num_warps = 1 if rows * experts_pad <= ROUTER_ONE_WARP_ELEMENTS else 4
    return RouterLaunch(rows, experts_pad, triton.next_power_of_2(top_k), num_warps)


@triton.jit
def _router_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_lt,
                   TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                   TOP_K_PAD: tl.constexpr, SOFTMAX_AFTER_TOPK: tl.constexpr = False,
                   UNIFORM_WEIGHTS: tl.constexpr = False):
    """Per row: probs = softmax(logits) in float32; the TOP_K largest logits (the softmax keeps their order; ties go
    to the lowest expert id, NaN ranks last); their probs, divided by their sum when RENORMALIZE. SOFTMAX_AFTER_TOPK
    (gpt-oss): the softmax of the TOP_K logits alone, exp(logit - max) over its sum, as torch.softmax rounds it.
    UNIFORM_WEIGHTS (the routing simulation, on random scores): every weight 1 / TOP_K."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_tokens
    experts = tl.arange(0, EXPERTS_PAD)
    lane_ok = experts < num_experts
    ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_lt + experts[None, :]
    logits = tl.load(ptrs, mask=row_ok[:, None] & lane_ok[None, :], other=float("-inf")).to(tl.float32)
    peak = tl.where(row_ok, tl.max(logits, axis=1), 0.0)  # rows past the last: no -inf - -inf
    exps = tl.exp(logits - peak[:, None])
    if SOFTMAX_AFTER_TOPK:
        probs = exps  # normalized over the chosen ones below
    else:
        probs = exps / tl.where(row_ok, tl.sum(exps, axis=1), 1.0)[:, None]
    # Rank the logits themselves: exact, where the rounded probabilities could tie two different logits.
    key = tl.where(logits == logits, logits, float("-inf"))  # noqa: PLR0124 - NaN ranks last, an id stays in range
    taken = tl.broadcast_to(~lane_ok[None, :], (ROWS, EXPERTS_PAD))  # the padding lanes are never chosen
    slots = tl.arange(0, TOP_K_PAD)
    top_ids = tl.zeros((ROWS, TOP_K_PAD), dtype=tl.int32)
    top_probs = tl.zeros((ROWS, TOP_K_PAD), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), key), axis=1)
        pick = tl.min(tl.where((key == best[:, None]) & ~taken, experts[None, :], EXPERTS_PAD), axis=1)
        chosen = experts[None, :] == pick[:, None]
        taken = taken | chosen
        top_ids = tl.where(slots[None, :] == slot, pick[:, None], top_ids)
        top_probs = tl.where(slots[None, :] == slot, tl.sum(tl.where(chosen, probs, 0.0), axis=1)[:, None],
                             top_probs)
    if UNIFORM_WEIGHTS:
        top_probs = tl.full((ROWS, TOP_K_PAD), 1.0 / TOP_K, dtype=tl.float32)
    elif RENORMALIZE or SOFTMAX_AFTER_TOPK:
        top_probs = top_probs / tl.where(row_ok, tl.sum(top_probs, axis=1), 1.0)[:, None]
    out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    ok = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_probs.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, top_ids, mask=ok)


@dataclass(frozen=True)
class RouterKey:
    logits_dtype: torch.dtype
    weights_dtype: torch.dtype
    num_experts: int
    top_k: int
    logits_stride: int  # the logits' row stride (a layer's constant)
    renormalize: bool
    softmax_after_topk: bool
    uniform_weights: bool
    launch: RouterLaunch
    tokens_class: int  # triton_int_class(num_tokens)
    num_tokens: int = field(default=1, compare=False)  # one token count of the class, for compile


class MoeRouter(CompiledKernel):
    """The router kernel's variants (one wrapper per process: ROUTER)."""
    parallel_compile = True

    def dispatch(self, *, num_tokens: int, num_experts: int, top_k: int, logits_dtype: torch.dtype,
                 weights_dtype: torch.dtype, renormalize: bool, softmax_after_topk: bool = False,
                 uniform_weights: bool = False, logits_stride: int | None = None) -> RouterKey:
        return RouterKey(logits_dtype, weights_dtype, num_experts, top_k,
                         num_experts if logits_stride is None else logits_stride, renormalize, softmax_after_topk,
                         uniform_weights, router_launch(num_tokens, num_experts, top_k),
                         triton_int_class(num_tokens), num_tokens)

    def compile(self, key: RouterKey) -> object:
        logits = torch.empty(key.num_tokens, key.logits_stride, dtype=key.logits_dtype, device="meta")
        with compile_only():
            return _route(key, logits[:, :key.num_experts])


ROUTER = MoeRouter()


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype,
          softmax_after_topk: bool = False, uniform_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in dtype, expert ids [T, k] int32, in descending order of weight): select_experts in one
    launch. The experts are torch.topk's on the float32 softmax, ranked on the logits (the softmax keeps their order;
    where exp rounds two different logits to one probability, the larger logit wins), equal logits to the lowest id.
    uniform_weights: weights 1 / k (the routing simulation's, on random scores; renormalize is then moot)."""
    num_tokens, num_experts = router_logits.shape
    if num_tokens == 0:
        return (torch.empty(0, top_k, dtype=dtype, device=router_logits.device),
                torch.empty(0, top_k, dtype=torch.int32, device=router_logits.device))
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    key = ROUTER.dispatch(num_tokens=num_tokens, num_experts=num_experts, top_k=top_k,
                          logits_dtype=router_logits.dtype, weights_dtype=dtype, renormalize=renormalize,
                          softmax_after_topk=softmax_after_topk, uniform_weights=uniform_weights,
                          logits_stride=router_logits.stride(0))
    ROUTER.ensure(key)
    return _route(key, router_logits)


def _route(key: RouterKey, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, top_k, device = router_logits.shape[0], key.top_k, router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=key.weights_dtype, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    rl = key.launch
    launch_kernel(_router_kernel, (triton.cdiv(num_tokens, rl.rows),),
                  (router_logits, weights, ids, num_tokens, key.num_experts, router_logits.stride(0)),
                  dict(TOP_K=top_k, RENORMALIZE=key.renormalize, ROWS=rl.rows, EXPERTS_PAD=rl.experts_pad,
                       TOP_K_PAD=rl.top_k_pad, SOFTMAX_AFTER_TOPK=key.softmax_after_topk,
                       UNIFORM_WEIGHTS=key.uniform_weights, num_warps=rl.num_warps))
    return weights, ids


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted pair list: every expert may leave a partly filled block."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m


@dataclass(frozen=True)
class AlignLaunch:
    experts_pad: int  # the experts' power-of-two lane count
    pairs_per_step: int  # pairs one-hot encoded at a time
    chunk: int  # pairs per program (a multiple of pairs_per_step)
    num_programs: int  # 1: one launch does everything; more: a counting launch, then a placing one
    blocks_per_step: int  # blocks marked at a time


def align_launch(num_pairs: int, num_experts: int, block_m: int) -> AlignLaunch:
    """Pure function of shapes (the pair count is a graph's capture size times k under graphs): one program while
    its steps are few (a decode step), else chunks of pairs over at most MAX_ALIGN_PROGRAMS programs."""
    for name, value in (("num_pairs", num_pairs), ("num_experts", num_experts), ("block_m", block_m)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    experts_pad = triton.next_power_of_2(num_experts)
    per_step = max(16, min(triton.next_power_of_2(num_pairs), _TILE_ELEMENTS // experts_pad))
    steps = triton.cdiv(num_pairs, per_step)
    if steps <= MAX_ONE_PROGRAM_STEPS:
        chunk = steps * per_step
    else:
        chunk = triton.cdiv(triton.cdiv(num_pairs, MAX_ALIGN_PROGRAMS), per_step) * per_step
    blocks_per_step = max(16, min(4096 // block_m, _TILE_ELEMENTS // experts_pad))
    return AlignLaunch(experts_pad, per_step, chunk, triton.cdiv(num_pairs, chunk), blocks_per_step)


@triton.jit
def _one_hot(ids_ptr, pairs, end, expert_offset, num_experts, EXPERTS_PAD: tl.constexpr):
    """[pairs, experts] int32, 1 where the pair goes to the (local) expert, and the local ids: -1, a row of zeros,
    for ids outside [expert_offset, expert_offset + num_experts) (-1 among them) and pairs past end."""
    expert = tl.load(ids_ptr + pairs, mask=pairs < end, other=-1).to(tl.int32) - expert_offset
    expert = tl.where((expert >= 0) & (expert < num_experts) & (pairs < end), expert, -1)
    return (expert[:, None] == tl.arange(0, EXPERTS_PAD)[None, :]).to(tl.int32), expert


@triton.jit
def _count(ids_ptr, start, end, expert_offset, num_experts, PER_STEP: tl.constexpr, EXPERTS_PAD: tl.constexpr):
    counts = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for s in range(start, end, PER_STEP):
        hot, _ = _one_hot(ids_ptr, s + tl.arange(0, PER_STEP), end, expert_offset, num_experts, EXPERTS_PAD)
        counts += tl.sum(hot, axis=0)
    return counts


@triton.jit
def _groups(counts, num_experts, BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr):
    """Each expert's first row and the end of its padded group (past every group for the padding lanes)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    lanes = tl.arange(0, EXPERTS_PAD)
    return padded_end - padded, tl.where(lanes < num_experts, padded_end, 2147483647)


@triton.jit
def _place(ids_ptr, sorted_ids_ptr, start, end, first_row, expert_offset, num_experts, PER_STEP: tl.constexpr,
           EXPERTS_PAD: tl.constexpr):
    """sorted_ids[row] = pair for pairs [start, end), first_row[e] being the row of the range's first pair of e; in
    pair order within an expert, as a stable sort places them."""
    next_row = first_row
    for s in range(start, end, PER_STEP):
        pairs = s + tl.arange(0, PER_STEP)
        hot, expert = _one_hot(ids_ptr, pairs, end, expert_offset, num_experts, EXPERTS_PAD)
        before = tl.cumsum(hot, axis=0) - hot  # earlier pairs of the same expert in this step
        row = tl.sum(hot * (before + next_row[None, :]), axis=1)
        tl.store(sorted_ids_ptr + row, pairs, mask=expert >= 0)
        next_row += tl.sum(hot, axis=0)


@triton.jit
def _mark_blocks(sorted_ids_ptr, block_expert_ptr, counts, group_start, padded_end, first_block, end_block,
                 num_pairs, num_experts, BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr, EXPERTS_PAD: tl.constexpr):
    """block_expert[b] for blocks [first_block, end_block) (-1 past the last group), and the id num_pairs in every
    row no pair takes: a group's padding and the blocks past the last group."""
    experts = tl.arange(0, EXPERTS_PAD)
    live_end = group_start + counts
    for b0 in range(first_block, end_block, BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        block_ok = blocks < end_block
        row0 = blocks * BLOCK_M
        expert = tl.sum((padded_end[None, :] <= row0[:, None]).to(tl.int32), axis=1)  # searchsorted, right side
        own = (experts[None, :] == expert[:, None]) & (expert[:, None] < num_experts)
        first_free = tl.sum(tl.where(own, live_end[None, :], 0), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(expert < num_experts, expert, -1), mask=block_ok)
        rows = row0[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ids_ptr + rows, rows * 0 + num_pairs, mask=block_ok[:, None] & (rows >= first_free[:, None]))


@triton.jit
def _align_one_program_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, expert_offset, num_experts,
                              num_blocks, BLOCK_M: tl.constexpr, PER_STEP: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                              BLOCKS: tl.constexpr):
    counts = _count(ids_ptr, 0, num_pairs, expert_offset, num_experts, PER_STEP, EXPERTS_PAD)
    group_start, padded_end = _groups(counts, num_experts, BLOCK_M, EXPERTS_PAD)
    _place(ids_ptr, sorted_ids_ptr, 0, num_pairs, group_start, expert_offset, num_experts, PER_STEP, EXPERTS_PAD)
    _mark_blocks(sorted_ids_ptr, block_expert_ptr, counts, group_start, padded_end, 0, num_blocks, num_pairs,
                 num_experts, BLOCK_M, BLOCKS, EXPERTS_PAD)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, num_pairs, expert_offset, num_experts, chunk_pairs,
                        PER_STEP: tl.constexpr, EXPERTS_PAD: tl.constexpr):
    """counts[c, e]: the pairs of expert e in chunk c."""
    chunk = tl.program_id(0)
    start = chunk * chunk_pairs
    counts = _count(ids_ptr, start, tl.minimum(start + chunk_pairs, num_pairs), expert_offset, num_experts, PER_STEP,
                    EXPERTS_PAD)
    tl.store(counts_ptr + chunk * EXPERTS_PAD + tl.arange(0, EXPERTS_PAD), counts)


@triton.jit
def _align_place_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, expert_offset,
                        num_experts, num_chunks, chunk_pairs, num_blocks, blocks_per_program, BLOCK_M: tl.constexpr,
                        PER_STEP: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCKS: tl.constexpr):
    """Chunk c's pairs after those of the chunks before it (each program sums every chunk's counts itself), and a
    share of the blocks."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_PAD)
    totals = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    earlier = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for c in range(num_chunks):
        counts = tl.load(counts_ptr + c * EXPERTS_PAD + experts)
        totals += counts
        earlier += tl.where(c < chunk, counts, 0)
    group_start, padded_end = _groups(totals, num_experts, BLOCK_M, EXPERTS_PAD)
    start = chunk * chunk_pairs
    _place(ids_ptr, sorted_ids_ptr, start, tl.minimum(start + chunk_pairs, num_pairs), group_start + earlier,
           expert_offset, num_experts, PER_STEP, EXPERTS_PAD)
    first_block = chunk * blocks_per_program
    _mark_blocks(sorted_ids_ptr, block_expert_ptr, totals, group_start, padded_end, first_block,
                 tl.minimum(first_block + blocks_per_program, num_blocks), num_pairs, num_experts, BLOCK_M, BLOCKS,
                 EXPERTS_PAD)


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_offset: int = 0,
                    launch: AlignLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [P] int32, expert of each block [P / block_m] int32), P = max_padded_pairs: pair
    p = token * k + slot, grouped by expert in ascending order and by pair within a group (a stable sort), each group
    padded to whole blocks with the id num_pairs; blocks past the last group have expert -1, and pairs of expert -1
    take no row. Equals surge/kernels/reference.py's align_to_blocks exactly.

    expert_offset: the ids are global and this rank holds experts [expert_offset, expert_offset + num_experts), the
    local ids being id - expert_offset; any other id (-1 among them) takes no row, like -1 with offset 0."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs, device = ids.numel(), ids.device
    padded_rows = max_padded_pairs(num_pairs, num_experts, block_m)
    num_blocks = padded_rows // block_m
    sorted_ids = torch.empty(padded_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    align = launch or align_launch(max(num_pairs, 1), num_experts, block_m)
    common = {"BLOCK_M": block_m, "PER_STEP": align.pairs_per_step, "EXPERTS_PAD": align.experts_pad}
    if align.num_programs == 1:
        launch_kernel(_align_one_program_kernel, (1,),
                      (ids, sorted_ids, block_expert, num_pairs, expert_offset, num_experts, num_blocks),
                      dict(BLOCKS=align.blocks_per_step, **common, num_warps=4))
        return sorted_ids, block_expert
    counts = torch.empty(align.num_programs, align.experts_pad, dtype=torch.int32, device=device)
    launch_kernel(_align_count_kernel, (align.num_programs,),
                  (ids, counts, num_pairs, expert_offset, num_experts, align.chunk),
                  dict(PER_STEP=align.pairs_per_step, EXPERTS_PAD=align.experts_pad, num_warps=4))
    launch_kernel(_align_place_kernel, (align.num_programs,),
                  (ids, counts, sorted_ids, block_expert, num_pairs, expert_offset, num_experts, align.num_programs,
                   align.chunk, num_blocks, triton.cdiv(num_blocks, align.num_programs)),
                  dict(BLOCKS=align.blocks_per_step, **common, num_warps=4))
    return sorted_ids, block_expert
