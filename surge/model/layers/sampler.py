"""Sampler: turns one step's logits [n, V] into one token per request, honouring each request's SamplingParams.
min_tokens → penalties → argmax | temperature, top-k, top-p, min-p, exponential race (Triton on CUDA without min-p).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from surge.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of the logits batch: one request that needs a token this step."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far (penalties, min_tokens)
    generator: torch.Generator | None = None  # per-request RNG seeded from params.seed; None: the global RNG
    # How many tokens were generated so far; callers that skip copying output_token_ids (no penalties) set it.
    num_output_tokens: int | None = None

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids) if self.num_output_tokens is None else self.num_output_tokens


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [n] int64
    # Only when some row asked for logprobs, from the raw logits; column 0 is the sampled token, then the top max_N.
    logprob_token_ids: torch.Tensor | None = None  # [n, 1 + max_N] int64
    logprobs: torch.Tensor | None = None  # [n, 1 + max_N] float32
    sampled_token_ranks: torch.Tensor | None = None  # [n] int64, 1-based rank of the sampled token


class Sampler:
    """Logprobs always come from the raw logits. Sampling takes one of two paths per batch, with the same
    semantics: the Triton kernel (surge/kernels/sampling.py) on CUDA when some sampling row asks for top-k or top-p
    and none for min-p (see _kernel_serves); else torch (sort, softmax, race). Greedy alone is one argmax."""

    def __init__(self, use_kernel: bool | None = None, max_batch: int = 0) -> None:
        # None: the kernel on CUDA only. True: on the CPU too (tests, under TRITON_INTERPRET=1). False: never.
        self.use_kernel = use_kernel
        self._kernel = None  # TopKTopPSampler, imported on first use: the import compiles nothing but needs Triton
        # The capacity launches are chosen for (a pure function of it): the engine's max_num_seqs, known before the
        # warm-up (which may run later, on a thread), so a batch launches alike before and after it.
        self._max_batch = max_batch

    def warm_up(self, device: torch.device, max_batch: int, vocab_size: int, dtype: torch.dtype,
                max_workers: int = 4) -> float:
        """Compile every kernel variant a step can launch, before serving: logits of the model's dtype, and float32
        ones (penalties and min_tokens work on a float32 copy). Returns the seconds it took (0 off the kernel)."""
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        if not self._kernel_enabled(device):
            return 0.0
        start = time.perf_counter()
        kernel = self._kernel_on(device)
        self._max_batch = max_batch
        kernel.compile_many([kernel.dispatch(max_batch=max_batch, vocab_size=vocab_size, max_k=vocab_size, dtype=d)
                             for d in dict.fromkeys([dtype, torch.float32])], max_workers=max_workers)
        return time.perf_counter() - start

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        max_n = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
        work = processed_logits(logits, rows)  # what is sampled from; the caller's tensor is never written
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            sampled = greedy_argmax(work)  # ties go to the lowest id
        elif self._kernel_serves(work, rows):
            sampled = self._sample_with_kernel(work, rows)
        else:
            work = work.float()
            is_greedy = device_tensor(greedy, logits.device, torch.bool)
            sampled = torch.where(is_greedy, greedy_argmax(work), _sample(work, rows))
        if max_n is None:
            return SamplerOutput(sampled)
        ids, logprobs, ranks = compute_token_logprobs(logits, sampled, max_n)
        return SamplerOutput(sampled, ids, logprobs, ranks)

    def _kernel_enabled(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.use_kernel is None else self.use_kernel

    def _kernel_serves(self, logits: torch.Tensor, rows: list[SamplingRow]) -> bool:
        """Per batch: some sampling row asks for top-k or top-p (what the kernel is for: no sort), none for min-p
        (which it lacks). Temperature alone stays a softmax and an argmax in torch."""
        if not self._kernel_enabled(logits.device):
            return False
        sampling = [r.params for r in rows if not r.params.greedy]
        return (all(p.min_p == 0.0 for p in sampling)
                and any(0 < p.top_k < logits.shape[1] or p.top_p < 1.0 for p in sampling))

    def _kernel_on(self, device: torch.device):
        if self._kernel is None or self._kernel.device != device:
            from surge.kernels.sampling import TopKTopPSampler  # Triton reads TRITON_INTERPRET when this is imported

            self._kernel = TopKTopPSampler(device)
        return self._kernel

    def _sample_with_kernel(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Every row in one launch: greedy rows as temperature 0, top-k 0 (off) when it keeps the whole row."""
        n, vocab_size = logits.shape
        assert vocab_size < 2 ** 24  # top-k travels as float32 below
        params = [r.params for r in rows]
        # One host-to-device copy for the three per-row values.
        per_row = device_tensor([[p.temperature for p in params], [p.top_p for p in params],
                                 [float(p.top_k) if p.top_k < vocab_size else 0.0 for p in params]],
                                logits.device, torch.float32)
        noise = exponential_noise(rows, vocab_size, logits.device, clamp=False)  # the kernel clamps q itself
        # Launches are chosen for the capacity warm_up was given; without it (tests), for the next power of two.
        max_batch = self._max_batch if n <= self._max_batch else 1 << (n - 1).bit_length()
        return self._kernel_on(logits.device)(
            logits if logits.stride(-1) == 1 else logits.contiguous(), per_row[0], per_row[2].to(torch.int32),
            per_row[1], noise, max_batch=max_batch, max_k=vocab_size)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of [n, V], the lowest id among ties (and the first NaN, as argmax). On the CPU in two
    passes over blocks: torch's argmax kernel runs at a fraction of the vectorized max's speed (default model,
    16 x 49,152: 340 -> 70 us, 2 threads). The first block holding a row's maximum holds its lowest such id."""
    n, vocab_size = logits.shape
    block = min(1024, vocab_size & -vocab_size)  # the largest power of two dividing V, at most 1024
    if logits.device.type != "cpu" or block < 64 or vocab_size < 8 * block or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    blocks = logits.view(n, vocab_size // block, block)
    first = blocks.amax(dim=-1).argmax(dim=-1)
    within = blocks[torch.arange(n), first].argmax(dim=-1)
    return first * block + within


def compute_token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                           num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs of target_ids [m] under logits [m, V], plus the top num_top per row.

    Returns ids [m, 1 + num_top] (column 0 the target), logprobs [m, 1 + num_top] and the target's 1-based rank [m];
    tokens tied with the target do not push its rank down (vLLM's convention).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_ids = target_ids.long()[:, None]
    target_logprobs = logprobs.gather(1, target_ids)
    ranks = (logprobs > target_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return (torch.cat([target_ids, top_ids], dim=1), torch.cat([target_logprobs, top_logprobs], dim=1), ranks)


def device_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small tensor from host values, copied (pinned, async) without making the host wait for the device's queued
    work: with async scheduling a step's work is still queued when the next one is prepared. A numpy array is read
    in place (no host copy before the pinned one)."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def processed_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits each row samples from before temperature: stop tokens masked while min_tokens holds, then the
    penalties (a float32 copy when either applies; else the caller's tensor itself, never written)."""
    vocab_size = logits.shape[1]
    masked = [(i, t) for i, r in enumerate(rows) if r.num_generated < r.params.min_tokens
              for t in r.params.all_stop_token_ids if t < vocab_size]
    if not masked and not _has_penalties(rows):
        return logits
    work = logits.float()
    work = work.clone() if work is logits else work
    if masked:
        row_idx, token_idx = device_tensor(masked, logits.device).T
        work[row_idx, token_idx] = float("-inf")
    _apply_penalties(work, rows)
    return work


def _has_penalties(rows: list[SamplingRow]) -> bool:
    return any(r.params.uses_penalties for r in rows)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[n, V] float32 occurrence counts, built with one scatter rather than a loop over tokens."""
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    token_ids = device_tensor(list(itertools.chain.from_iterable(token_lists)), device, torch.long)
    if token_ids.numel():
        lengths = device_tensor([len(t) for t in token_lists], device)
        row_idx = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
        counts.index_put_((row_idx, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True)
    return counts


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    params = [r.params for r in rows]
    repetition = [p.repetition_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    presence = [p.presence_penalty for p in params]
    if not _has_penalties(rows):
        return
    n, vocab_size = logits.shape
    device = logits.device
    # Rows without penalties contribute no tokens, so their logits come through unchanged.
    output_counts = _token_counts(
        [r.output_token_ids if p.uses_penalties else []
         for r, p in zip(rows, params)], vocab_size, device)
    if any(r != 1.0 for r in repetition):
        prompt_counts = _token_counts(
            [r.prompt_token_ids if p.repetition_penalty != 1.0 else [] for r, p in zip(rows, params)],
            vocab_size, device)
        penalty = device_tensor(repetition, device)[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where((prompt_counts + output_counts) > 0, penalized, logits))
    frequency_t = device_tensor(frequency, device)[:, None]
    presence_t = device_tensor(presence, device)[:, None]
    logits -= frequency_t * output_counts + presence_t * (output_counts > 0).float()


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Random draw for every row (greedy rows get a meaningless token that the caller discards)."""
    probs = sampling_probs(logits, rows)
    return probs.div_(exponential_noise(rows, logits.shape[1], logits.device)).argmax(dim=-1)


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row samples from: temperature, top-k, top-p, min-p, softmax (float32 [n, V]; greedy
    rows get temperature 1, a distribution their caller does not use)."""
    params = [r.params for r in rows]
    vocab_size = logits.shape[1]
    device = logits.device
    temperature = device_tensor([p.temperature if not p.greedy else 1.0 for p in params], device)
    logits = logits / temperature[:, None]
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _apply_top_k_top_p(logits, device_tensor(top_k, device), device_tensor(top_p, device))
    min_p = [p.min_p for p in params]
    if any(min_p):
        probs = logits.softmax(dim=-1)
        threshold = device_tensor(min_p, device)[:, None] * probs.amax(dim=-1, keepdim=True)
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits.softmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks to -inf what top-k (ties with the k-th kept, as in HF) and then top-p drop; one sort for both."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    kth_largest = sorted_logits.gather(1, (top_k - 1)[:, None])
    sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # 0 for the most likely token, so at least one always survives
    # top_p == 1 must keep everything even when rounding pushes the cumulative sum to 1 before the tail.
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def exponential_noise(rows: list[SamplingRow], vocab_size: int, device: torch.device,
                       clamp: bool = True) -> torch.Tensor:
    """q ~ Exp(1) per row: seeded rows draw only from their own generator, so the batch cannot change their tokens."""
    shared = [i for i, r in enumerate(rows) if r.generator is None and not r.params.greedy]
    if len(shared) == len(rows):
        noise = torch.empty(len(rows), vocab_size, device=device).exponential_()
    else:
        noise = torch.ones(len(rows), vocab_size, device=device)
        if shared:
            noise.index_copy_(0, device_tensor(shared, device, torch.long),
                              torch.empty(len(shared), vocab_size, device=device).exponential_())
    for i, r in enumerate(rows):
        if r.generator is not None and not r.params.greedy:
            noise[i].exponential_(generator=r.generator)
    # A zero draw would turn probs / q into inf or nan and pick a masked token.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny) if clamp else noise
