"""The rejection rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023) on tensors: accept a draft
token x with probability min(1, p(x)/q(x)), else draw from normalise(max(0, p - q)); the result is distributed as p.
A proposer that picks its tokens without a distribution (n-gram lookup, a greedy draft) is a point mass q = 1 on x:
acceptance is p(x) and the residual is p without x. Draws come in as tensors, so the caller owns every RNG.
"""
from __future__ import annotations

import torch


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One draw per row from probs [m, V] (need not be normalised) given noise ~ Exp(1) [m, V]: argmax of p / q is
    distributed as p (the exponential race); noise of ones gives the argmax (greedy rows)."""
    return (probs / noise).argmax(dim=-1)


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, uniform: torch.Tensor,
                     noise: torch.Tensor, draft_probs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft position per row: target_probs p [m, V], the draft tokens x [m], uniform u [m] in [0, 1), noise
    [m, V] ~ Exp(1) for the residual draw, draft_probs q [m, V] (None: a point mass on x).

    Returns (accepted [m] bool, the token at each position [m]: x where accepted, the residual draw elsewhere)."""
    x = draft_token_ids.long()[:, None]
    p_x = target_probs.gather(1, x).squeeze(1)
    if draft_probs is None:
        accepted = uniform < p_x  # u < min(1, p(x) / 1)
        residual = target_probs.scatter(1, x, 0.0)
    else:
        q_x = draft_probs.gather(1, x).squeeze(1)
        accepted = uniform * q_x < p_x  # u < p(x)/q(x) without dividing by a q(x) that rounding made 0
        residual = (target_probs - draft_probs).clamp_min_(0.0)
    # An empty residual (p <= q everywhere, so p == q) can only follow an acceptance; p keeps the draw defined.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    return accepted, torch.where(accepted, x.squeeze(1), race(residual, noise))
