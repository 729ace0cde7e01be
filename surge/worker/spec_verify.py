"""Verification of draft tokens on the rank that samples: each request's k + 1 positions (its last known token and
each draft) become sampling rows as if decoded one by one, then surge/spec_decode/rejection.py decides.

Row j of a request sees the output so far plus drafts [0, j): its penalties count those tokens and its min_tokens
mask holds while fewer than min_tokens were generated before it, so p is exactly the distribution the request
would have sampled from at that position (after temperature, top-k, top-p, min-p). Greedy rows are a point mass on
the argmax; seeded rows draw their uniforms and noise from the request's own generator, in a fixed order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from surge.model.layers.sampler import (SamplingRow, compute_token_logprobs, device_tensor, exponential_noise,
                                        processed_logits, sampling_probs)
from surge.spec_decode.rejection import race, rejection_sample
from surge.worker.request_state import CachedRequestState


@dataclass
class VerifyResult:
    """On the device: the token at every position (drafts where accepted, then the residual or bonus draw), the
    leading accepted drafts per request, and, when some request asked, logprobs of every position's token."""
    token_ids: torch.Tensor  # [sum(k_i + 1)]
    num_accepted: torch.Tensor | None  # [n]; None: greedy verdicts left to the host (verify's device_verdicts)
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # ids, logprobs, ranks per position


def verify_rows(state: CachedRequestState, drafts: list[int] | int) -> list[SamplingRow]:
    """The k + 1 sampling rows of one request whose drafts follow its whole known sequence. drafts: the tokens, or
    only their count k when they are on the device alone (a request scheduled ahead of its verdict: it uses no
    penalties, and no min_tokens holds back a stop token, so its rows need neither the drafts nor its newest
    outputs)."""
    p = state.params
    base = state.num_output_tokens
    outputs = state.output_token_ids if p.uses_penalties else []
    if isinstance(drafts, int):
        assert not p.uses_penalties, state.request_id
        drafts = [0] * drafts
    rows = []
    for j in range(len(drafts) + 1):
        history = outputs + drafts[:j] if p.uses_penalties else []
        rows.append(SamplingRow(p, state.prompt_token_ids, history, state.generator, base + j))
    return rows


def verify(logits: torch.Tensor, requests: list[tuple[CachedRequestState, list[int] | int]],
           device_verdicts: bool = True, draft_ids: torch.Tensor | None = None) -> VerifyResult:
    """logits [sum(k_i + 1), V]: each request's k_i + 1 positions in order, requests in the given order, each with
    its drafts (or their count: verify_rows). draft_ids: every request's drafts on the device [sum k_i] (the step's
    own input tokens), needed when some are only there; None: uploaded from the lists.
    device_verdicts=False: when every row is greedy and none wants logprobs, only the argmax is computed and the
    accepted counts are left to the host (VerifiedDrafts.into compares the drafts), ~10 launches and 5 copies
    fewer per step; a proposer that continues from the verdicts on the device needs them there."""
    device = logits.device
    rows = [row for state, drafts in requests for row in verify_rows(state, drafts)]
    work = processed_logits(logits, rows)
    num_drafts = [drafts if isinstance(drafts, int) else len(drafts) for _, drafts in requests]
    if draft_ids is None:
        draft_ids = device_tensor([t for _, drafts in requests for t in drafts], device, torch.long)
    if all(r.params.greedy for r in rows):  # the argmax everywhere: no distribution, no draws
        if not device_verdicts and all(r.params.logprobs is None for r in rows):
            return VerifyResult(work.argmax(dim=-1), None)
        return _finish(logits, rows, *_verify_greedy(work, draft_ids, num_drafts, device))
    work = work.float()
    greedy = device_tensor([r.params.greedy for r in rows], device, torch.bool)
    probs = sampling_probs(work, rows)
    if any(r.params.greedy for r in rows):
        one_hot = torch.zeros_like(probs).scatter_(1, work.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    uniform = _uniforms(requests, num_drafts, device)  # drawn before the noise: a fixed order per generator
    noise = exponential_noise(rows, logits.shape[1], device)  # ones for greedy rows
    draft_t, bonus_t = _positions(num_drafts, device)
    accepted, at_drafts = rejection_sample(probs[draft_t], draft_ids, uniform, noise[draft_t])
    token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
    token_ids[draft_t] = at_drafts
    token_ids[bonus_t] = race(probs[bonus_t], noise[bonus_t])
    return _finish(logits, rows, token_ids, accepted, num_drafts)


def _positions(num_drafts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of the draft positions and of the bonus positions."""
    bonus_idx, draft_idx, o = [], [], 0
    for k in num_drafts:
        draft_idx.extend(range(o, o + k))
        bonus_idx.append(o + k)
        o += k + 1
    return device_tensor(draft_idx, device, torch.long), device_tensor(bonus_idx, device, torch.long)


def _verify_greedy(work: torch.Tensor, draft_ids: torch.Tensor, num_drafts: list[int], device: torch.device):
    """p a point mass on the argmax at every row: a draft is accepted when it is the argmax, and the token at each
    position is the argmax (the draft itself where accepted)."""
    token_ids = work.argmax(dim=-1)
    k = _uniform(num_drafts)
    if k:  # every request verifies k: its drafts' rows are the first k of its k + 1, no index to upload
        at_drafts = token_ids.view(len(num_drafts), k + 1)[:, :k].reshape(-1)
    else:
        at_drafts = token_ids[_positions(num_drafts, device)[0]]
    return token_ids, at_drafts == draft_ids, num_drafts


def _uniform(num_drafts: list[int]) -> int:
    """k when every request verifies k > 0 drafts (every step of device drafts), else 0."""
    k = num_drafts[0] if num_drafts else 0
    return k if k and all(d == k for d in num_drafts) else 0


def _finish(logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor, accepted: torch.Tensor,
            num_drafts: list[int]) -> VerifyResult:
    result = VerifyResult(token_ids, num_accepted(accepted, num_drafts))
    max_n = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
    if max_n is not None:  # from the raw logits, as the sampler's
        result.logprobs = compute_token_logprobs(logits, token_ids, max_n)
    return result


def num_accepted(accepted: torch.Tensor, num_drafts: list[int]) -> torch.Tensor:
    """Leading accepted drafts per request: accepted [sum k_i] bool in request order, num_drafts the k_i (on the
    host, so the grid's shape and indices need no read of the device: a verification step never waits for it)."""
    n, k_max = len(num_drafts), max(num_drafts, default=0)
    if _uniform(num_drafts):
        return accepted.view(n, k_max).long().cumprod(dim=1).sum(dim=1)
    flat = np.concatenate([i * k_max + np.arange(k, dtype=np.int64) for i, k in enumerate(num_drafts)] or
                          [np.zeros(0, dtype=np.int64)])
    grid = torch.ones(n * k_max, dtype=torch.int64, device=accepted.device)  # padding counts as accepted...
    grid[device_tensor(flat, accepted.device)] = accepted.long()
    leading = grid.view(n, k_max).cumprod(dim=1).sum(dim=1)
    return torch.minimum(leading, device_tensor(np.asarray(num_drafts, dtype=np.int64), accepted.device))  # ...cut


def _uniforms(requests: list[tuple[CachedRequestState, list[int] | int]], num_drafts: list[int],
              device: torch.device) -> torch.Tensor:
    """u in [0, 1) per draft: a seeded request's from its generator; greedy ones 0.5 (their p(x) is 0 or 1)."""
    parts = []
    for (state, _), k in zip(requests, num_drafts):
        if state.params.greedy:
            parts.append(torch.full((k,), 0.5, device=device))
        else:
            parts.append(torch.rand(k, device=device, generator=state.generator))
    return torch.cat(parts)


@dataclass
class VerifiedDrafts:
    """A step's verdicts on their way to the host: per request its id, k, logprobs wanted; the tensors of
    VerifyResult (host copies, read once the step's event passed)."""
    request_ids: list[str]
    drafts: list[list[int] | int]  # the tokens, or their count where only the device has them (verify_rows)
    num_logprobs: list[int | None]
    token_ids: torch.Tensor
    num_accepted: torch.Tensor | None  # None: greedy, counted here (each draft accepted while it is the argmax)
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None

    @property
    def num_drafts(self) -> list[int]:
        return [d if isinstance(d, int) else len(d) for d in self.drafts]

    def into(self, result) -> None:
        """Each request's 1 + accepted tokens (and their logprobs) into a ModelRunnerOutput."""
        tokens = self.token_ids.tolist()
        accepted = self.num_accepted.tolist() if self.num_accepted is not None else _leading_matches(tokens,
                                                                                                    self.drafts)
        lp = None if self.logprobs is None else [t.tolist() for t in self.logprobs]
        o = 0
        for rid, k, num_lp, a in zip(self.request_ids, self.num_drafts, self.num_logprobs, accepted):
            result.sampled[rid] = tokens[o:o + a + 1]
            if num_lp is not None:
                ids, lps, ranks = lp
                result.logprobs[rid] = [(ids[j][:1 + num_lp], lps[j][:1 + num_lp], ranks[j])
                                        for j in range(o, o + a + 1)]
            o += k + 1


def _leading_matches(tokens: list[int], drafts: list[list[int]]) -> list[int]:
    """Per request, how many leading drafts equal the token verified at their position (its k + 1 rows in order)."""
    out, o = [], 0
    for d in drafts:
        a = 0
        while a < len(d) and tokens[o + a] == d[a]:
            a += 1
        out.append(a)
        o += len(d) + 1
    return out
