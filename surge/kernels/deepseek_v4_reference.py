"""Plain-torch definitions of DeepSeek V4's kernels (the lightning indexer's scores and top-k, the compressor's
pooling, the mHC pre-mix), written from HF transformers' `models/deepseek_v4`: the references the Triton kernels
are tested against, and the CPU path. No Triton here."""
from __future__ import annotations

import torch

INT32_MAX = 2 ** 31 - 1


def total_order_key(x: torch.Tensor) -> torch.Tensor:
    """float -> int32 keys ordering values totally: NaN above +inf (as torch.topk ranks it), then +inf ... -inf;
    -0.0 and +0.0 equal (so they tie, and ties go to the lower index)."""
    bits = x.float().contiguous().view(torch.int32)
    key = torch.where(bits >= 0, bits, bits ^ INT32_MAX)
    key = torch.where(x == 0, torch.zeros_like(key), key)
    return torch.where(x.isnan(), torch.full_like(key, INT32_MAX), key)


def indexer_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Per row r, the indices of the min(k, L_r) largest of scores[r, :L_r] (L_r = lengths[r] clamped to
    [0, scores.shape[1]]) in the total order of `total_order_key`, ties to the lower index, listed in ascending
    index order; the row's remaining slots -1. [rows, k] int32. Row by row with a stable sort, on the CPU."""
    scores, lengths = scores.cpu(), lengths.cpu()
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for row in range(scores.shape[0]):
        length = min(max(int(lengths[row]), 0), scores.shape[1])
        key = total_order_key(scores[row, :length])
        chosen = torch.sort(key, descending=True, stable=True).indices[:min(k, length)]
        out[row, :chosen.numel()] = chosen.sort().values.to(torch.int32)
    return out


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float,
                   weights_scale: float) -> torch.Tensor:
    """HF's DeepseekV4IndexerScorer: sum over heads h of relu(q[t, h] . keys[s]) * softmax_scale *
    (weights[t, h] * weights_scale), in float32. q [T, H, D]; weights [T, H] (weights_proj's output); keys [S, D]
    (the indexer's compressed keys) -> [T, S]."""
    scores = torch.relu(torch.einsum("thd,sd->ths", q.float(), keys.float())) * softmax_scale
    return (scores * (weights.float() * weights_scale).unsqueeze(-1)).sum(dim=1)
