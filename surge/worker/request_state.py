"""The model runner's own state of each request, fed only by step messages (the same in one process and in N).

A request crosses once (prompt, sampling parameters, and here its RNG is made); each step then appends the tokens
the runner lacks and patches its block tables from the message's diffs. Nothing here is shared with the engine.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from surge.core.request import TokenSequence
from surge.core.scheduler_output import NewRequest, ScheduledRequest, SchedulerOutput
from surge.sampling_params import SamplingParams


def sampling_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own RNG when it samples with a seed; None: it draws from the global RNG."""
    if params.seed is None or params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


class CachedRequestState(TokenSequence):
    """What the runner knows of one request: its tokens as far as the host sent them, block tables, RNG."""

    def __init__(self, new: NewRequest, num_groups: int, device: torch.device,
                 mrope_positions: Callable | None = None) -> None:
        """mrope_positions: an M-RoPE model's (prompt ids, images) -> (prompt positions [3, P] or None, delta)."""
        self.request_id = new.request_id
        self.prompt_token_ids = new.prompt_token_ids
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.params = new.params
        self.pooling_params = new.pooling_params
        self.lora_request = new.lora_request
        self.mm_features = new.mm_features
        # An M-RoPE model's prompt positions (None: all three axes are the sequence position) and the offset of
        # every later token's position from its sequence position.
        self.mrope_positions: np.ndarray | None = None
        self.mrope_delta = 0
        if mrope_positions is not None:
            self.mrope_positions, self.mrope_delta = mrope_positions(new.prompt_token_ids, new.mm_features)
        self.pooled: torch.Tensor | None = None  # a pooling request's state across prefill chunks (worker/pooling.py)
        self.token_ids = list(new.prompt_token_ids)
        self.block_ids: list[list[int]] = [[] for _ in range(num_groups)]
        self.generator = sampling_generator(new.params, device)
        # Prompt positions whose logprobs were already returned (prompt logprobs are computed once).
        self.num_prompt_logprobs_done = 0

    def apply(self, s: ScheduledRequest) -> None:
        if s.new_token_ids:
            self.token_ids.extend(s.new_token_ids)
        for table, start, ids in zip(self.block_ids, s.block_starts, s.new_block_ids):
            if start < len(table):
                del table[start:]
            if ids:
                table.extend(ids)


class RequestStates:
    """Every request the runner holds, by id, until a step message says it finished."""

    def __init__(self, num_groups: int, device: torch.device, mrope_positions: Callable | None = None) -> None:
        self.num_groups = num_groups
        self.device = device
        self.mrope_positions = mrope_positions
        self.requests: dict[str, CachedRequestState] = {}

    def apply(self, out: SchedulerOutput) -> list[CachedRequestState]:
        """Bring the state up to date with one step; returns the scheduled requests' states, in step order."""
        for rid in out.finished_ids:
            self.requests.pop(rid, None)
        for new in out.new_requests:
            self.requests[new.request_id] = CachedRequestState(new, self.num_groups, self.device,
                                                                  self.mrope_positions)
        states = []
        for s in out.scheduled:
            state = self.requests[s.request_id]
            state.apply(s)
            states.append(state)
        return states
