"""The n-gram (prompt lookup) step on the device, in one launch: each request's new tokens join its token history
and its drafts are looked up there (the longest suffix of length max_n..min_n seen earlier, its most recent
occurrence, the k tokens after it).

Under async scheduling this runs after every sampling step. Written as the torch ops it replaces it was ~45 small
launches, ~1 ms of host time per step at batch 1 (measured on the H200), as much as a whole decode step of a small
model; here it is one program per request, scanning its history in blocks.

A request's new tokens come from one of two sources: a sampled token (`sampled[src]`, one token) or a verdict
(`verdicts[src:src + accepted + 1]`, the accepted drafts and the token after them, accepted read from the device).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# meta's columns, one row per request: its history row, 1 if its tokens are a verdict, where they start in their
# source, the drafts it verified, and where its accepted count is (index into `accepted`, times its stride).
META_COLUMNS = 5


# Nothing specialized on its arguments' values or alignment: the warm-up's one variant is every launch's (meta and
# the verdicts' accepted counts are views at any offset), and these loads gain nothing from it.
@triton.jit(do_not_specialize=list(range(11)))
def _ngram_step_kernel(tokens_ptr, lengths_ptr, stride_tokens, meta_ptr, sampled_ptr, verdicts_ptr, accepted_ptr,
                       stride_accepted, out_ptr, rejected_ptr, valid_ptr,
                       K: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, NEW_PAD: tl.constexpr,
                       K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(meta_ptr + i * 5).to(tl.int64)
    is_verdict = tl.load(meta_ptr + i * 5 + 1) != 0
    src = tl.load(meta_ptr + i * 5 + 2).to(tl.int64)
    num_drafts = tl.load(meta_ptr + i * 5 + 3)
    acc_index = tl.load(meta_ptr + i * 5 + 4).to(tl.int64)
    accepted = tl.load(accepted_ptr + acc_index * stride_accepted, mask=is_verdict, other=0).to(tl.int64)
    count = accepted + 1
    hist = tokens_ptr + row * stride_tokens
    start_len = tl.load(lengths_ptr + row).to(tl.int64)

    # 1. The new tokens join the history.
    c = tl.arange(0, NEW_PAD)
    keep = c < count
    new = tl.where(is_verdict,
                   tl.load(verdicts_ptr + src + c, mask=keep & is_verdict, other=0).to(tl.int64),
                   tl.load(sampled_ptr + src + c, mask=keep & (c < 1) & ~is_verdict, other=0).to(tl.int64))
    tl.store(hist + start_len + c, new, mask=keep)
    length = start_len + count
    tl.store(lengths_ptr + row, length)
    newest = tl.sum(tl.where(c == accepted, new, 0))
    tl.debug_barrier()  # the stores above are read back below, by other threads of this program

    # 2. The lookup. For each end e <= length - 2, run = how many of the tokens ending at e agree with the
    # history's suffix, newest first (at most MAX_N, and never before the row's start); the key run * 2^32 + e
    # orders by run, then by recency.
    best = tl.full((), -1, tl.int64)
    for block in range(0, length - 1, BLOCK):
        e = block + tl.arange(0, BLOCK).to(tl.int64)
        alive = e <= length - 2
        run = tl.zeros((BLOCK,), tl.int64)
        for t in tl.static_range(MAX_N):
            suffix = tl.load(hist + length - 1 - t, mask=length - 1 - t >= 0, other=-1)
            alive = alive & (e - t >= 0) & (length - 1 - t >= 0)
            tok = tl.load(hist + e - t, mask=alive, other=-1)
            alive = alive & (tok == suffix)
            run += alive.to(tl.int64)
        key = tl.where(run >= MIN_N, (run << 32) + e, -1)
        best = tl.maximum(best, tl.max(key))
    found = best >= 0
    first = (best & 0xFFFFFFFF) + 1  # the token after the match
    valid = tl.where(found, tl.minimum(length - first, K), 0)

    # 3. Out: the newest token, then the drafts (the columns past the valid ones repeat the newest token).
    d = tl.arange(0, K_PAD)
    drafts = tl.load(hist + first + d, mask=(d < valid) & found, other=0)
    drafts = tl.where(d < valid, drafts, newest)
    tl.store(out_ptr + i * (K + 1), newest)
    tl.store(out_ptr + i * (K + 1) + 1 + d, drafts, mask=d < K)
    tl.store(rejected_ptr + i, tl.where(is_verdict, num_drafts - accepted, 0))
    tl.store(valid_ptr + i, valid)


def ngram_step(tokens: torch.Tensor, lengths: torch.Tensor, meta: torch.Tensor, sampled: torch.Tensor,
               verdicts: torch.Tensor, accepted: torch.Tensor, k: int, min_n: int, max_n: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [R, W] int64 histories and lengths [R] int64, updated in place (W past every length by k + 1);
    meta [n, 5] int64 (META_COLUMNS' layout); sampled and verdicts 1-D integer token sources; accepted 1-D counts
    (any stride). Returns (out [n, 1 + k]: newest token then k drafts, rejected [n], valid [n]), int64."""
    n = meta.shape[0]
    assert meta.shape[1] == META_COLUMNS and tokens.stride(1) == 1 and lengths.is_contiguous()
    out = torch.empty(n, k + 1, dtype=torch.int64, device=tokens.device)
    rejected = torch.empty(n, dtype=torch.int64, device=tokens.device)
    valid = torch.empty(n, dtype=torch.int64, device=tokens.device)
    if n:
        _ngram_step_kernel[(n,)](tokens, lengths, tokens.stride(0), meta, sampled, verdicts, accepted,
                                 accepted.stride(0), out, rejected, valid, **_launch(k, min_n, max_n))
    return out, rejected, valid


def warm_up_ngram_step(tokens: torch.Tensor, k: int, min_n: int, max_n: int) -> None:
    """Compile ngram_step's variant for tables like tokens, without launching it: warm-up may run beside serving."""
    scratch = torch.zeros(1, META_COLUMNS, dtype=torch.int64, device=tokens.device)
    _ngram_step_kernel.warmup(tokens, scratch, tokens.stride(0), scratch, scratch, scratch, scratch, 1, scratch,
                              scratch, scratch, grid=(1,), **_launch(k, min_n, max_n))


def _launch(k: int, min_n: int, max_n: int) -> dict:
    return dict(K=k, MIN_N=min_n, MAX_N=max_n, NEW_PAD=triton.next_power_of_2(k + 1),
                K_PAD=triton.next_power_of_2(k), BLOCK=512, num_warps=4)
