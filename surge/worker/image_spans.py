"""Bidirectional attention over each image (Gemma 3): the step's `causal_end`, per token the last key position it
may see when that is past its own. An image token sees its whole image, so the step that computes an image's tokens
must hold the image's last one: the scheduler never ends a chunk inside an image (SchedulerConfig.
disable_chunked_mm_input), and a chunk that starts inside one (after a prefix-cache hit) finds the image's earlier
tokens cached by a step that computed that whole image."""
from __future__ import annotations

import numpy as np
import torch

from surge.core.scheduler_output import ScheduledRequest
from surge.model.layers.sampler import device_tensor
from surge.worker.request_state import CachedRequestState


def image_causal_end(scheduled: list[ScheduledRequest], states: list[CachedRequestState], query_start_loc: list[int],
                     num_tokens: int, device: torch.device) -> torch.Tensor | None:
    """[num_tokens] int32: an image token's image's last position, 0 for any other token (it stays causal); None
    when the step computes no image token."""
    ends = None
    for i, (s, state) in enumerate(zip(scheduled, states)):
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        for f in state.mm_features:
            lo, hi = max(start, f.offset), min(end, f.end)
            if lo >= hi:
                continue
            if f.end > end:
                raise RuntimeError(f"request {s.request_id!r}: a chunk ends at {end}, inside an image's tokens "
                                   f"[{f.offset}, {f.end}); with bidirectional image attention the scheduler keeps "
                                   "each image in one step")
            if ends is None:
                ends = np.zeros(num_tokens, dtype=np.int32)
            row = query_start_loc[i] - start
            ends[row + lo:row + hi] = f.end - 1
    return None if ends is None else device_tensor(ends, device)
