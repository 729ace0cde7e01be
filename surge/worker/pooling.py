"""The pooling runner's share of a step: each pooling request's hidden states gathered across its prefill chunks
(the last token's, the first's, or their running sum for the mean), and, once its prompt is complete, the model's
head (none for embeddings, the classifier otherwise) and the request's own post-processing.

Every rank pools (the classifier may gather the LM head's slices); rank 0's output is the one returned.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from surge.config import ModelConfig
from surge.core.scheduler_output import ScheduledRequest
from surge.worker.request_state import CachedRequestState


def default_task(model_config: ModelConfig) -> str:
    return "classify" if model_config.is_cross_encoder else "embed"


def gather_pooled(pooling_type: str, scheduled: list[ScheduledRequest], states: list[CachedRequestState],
                  query_start_loc: list[int], hidden: torch.Tensor) -> list[tuple[CachedRequestState, torch.Tensor]]:
    """Advance every pooling request by this step's rows; returns (state, pooled hidden [H]) of those whose prompt
    this step completes. A chunk that starts at 0 starts the request over (its first, or again after preemption)."""
    done = []
    for i, (s, state) in enumerate(zip(scheduled, states)):
        if state.pooling_params is None:
            continue
        rows = hidden[query_start_loc[i]:query_start_loc[i + 1]]
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        if pooling_type == "MEAN":
            chunk = rows.float().sum(0)
            state.pooled = chunk if start == 0 else state.pooled + chunk
        elif pooling_type == "CLS" and start == 0:
            state.pooled = rows[0]
        if end < state.num_prompt_tokens:
            continue
        if pooling_type == "LAST":
            pooled = rows[-1]
        elif pooling_type == "MEAN":
            pooled = (state.pooled / state.num_prompt_tokens).to(hidden.dtype)
        else:
            pooled = state.pooled
        state.pooled = None
        done.append((state, pooled))
    return done


def finish_pooled(model: torch.nn.Module, model_config: ModelConfig,
                  done: list[tuple[CachedRequestState, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """Request id -> its output (float32, on the device): an embedding (Matryoshka-cut, then normalized, as asked),
    or class probabilities (sigmoid for one label, else softmax; raw logits without activation). None off rank 0."""
    pooler = model_config.pooler_config
    task_of = {state.request_id: state.pooling_params.task or default_task(model_config) for state, _ in done}
    pooled = torch.stack([vec for _, vec in done])
    classes = [j for j, (state, _) in enumerate(done) if task_of[state.request_id] in ("classify", "score")
               or (task_of[state.request_id] == "encode" and model_config.is_cross_encoder)]
    logits = model.classify(pooled[classes]) if classes else None
    if classes and logits is None:  # a rank other than 0
        return None
    logits_of = dict(zip(classes, logits.float())) if classes else {}
    out: dict[str, torch.Tensor] = {}
    for j, (state, vec) in enumerate(done):
        p = state.pooling_params
        if j in logits_of:
            row = logits_of[j]
            if _first_set(p.use_activation, pooler.use_activation, True):
                row = torch.sigmoid(row) if row.numel() == 1 else torch.softmax(row, dim=-1)
        else:
            row = vec.float()
            dims = _first_set(p.dimensions, pooler.dimensions, None)
            if dims is not None:
                row = row[:dims]
            if _first_set(p.normalize, pooler.normalize, True):
                row = F.normalize(row, p=2, dim=-1)
        out[state.request_id] = row
    return out


def _first_set(*values):
    return next((v for v in values if v is not None), None)
