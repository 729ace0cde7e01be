"""CUDA graphs: one per decode batch size up to max_num_seqs, and one per token count for small mixed steps (prefill
chunks, with or without decodes), all sharing one memory pool.

A decode step with n requests replays the smallest graph of size >= n, its extra rows padded into the null block.
A mixed step of t tokens replays the smallest mixed graph of >= t tokens, shaped for max_num_seqs requests: its
padding tokens belong to no request and its padding requests have no tokens (StepInputs.pad_mixed). Such steps
are short on the device (a follow-up turn on a long cached prefix, a short prompt) and were bound by the host
launching ~10 kernels per layer one by one; as a graph they launch once. The attention kernel reads every length from device memory and sizes its grid by token and request capacity, so
one capture serves every layout. Graphs capture views of StepInputs' persistent buffers, so a replay only needs
those buffers filled.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from surge.attention.backend import AttentionBackend
from surge.logger import init_logger
from surge.worker.step_inputs import StepInputs

logger = init_logger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, then every 16, always ending at max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, min(max_num_seqs, 256) + 1, 8)) + list(range(272, max_num_seqs + 1, 16))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(s for s in sizes if s <= max_num_seqs))


# Token counts of the mixed graphs. Above the largest, the device's time dominates the host's launches. None below
# 128: up to there an 8B model's GEMMs are bound by reading the weights, so padding 16 tokens to 128 costs nothing,
# and padding tokens skip attention; every graph is start-up time (~45 ms each at 8B).
MIXED_SIZES = (128, 256, 512)


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    return [t for t in MIXED_SIZES if t <= max_num_batched_tokens]


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, inputs: StepInputs, backend: AttentionBackend, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.model = model
        self.inputs = inputs
        self.backend = backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.mixed_sizes = mixed_capture_sizes(inputs.input_ids.shape[0])
        self.mixed_reqs = max_num_seqs  # requests a mixed graph is shaped for
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0

    def _meta(self, bs: int):
        # Capacity-shaped metadata: kernels read lengths from the tensors, never from these host values.
        return self.inputs.metadata(self.backend, bs, bs, list(range(bs + 1)), [], max_query_len=1,
                                    max_seq_len=self.max_model_len, for_capture=True)

    def _mixed_meta(self, num_tokens: int):
        return self.inputs.metadata(self.backend, num_tokens, self.mixed_reqs, list(range(self.mixed_reqs + 1)), [],
                                    max_query_len=num_tokens, max_seq_len=self.max_model_len, for_capture=True)

    @torch.inference_mode()
    def capture(self) -> float:
        start = time.perf_counter()
        inp = self.inputs
        # Largest first: later graphs reuse its pool memory.
        for t in reversed(self.mixed_sizes):
            inp.pad_mixed(0, 0, t, self.mixed_reqs)
            self.mixed_graphs[t], self.mixed_outputs[t] = self._capture_one(t, self._mixed_meta(t))
        for bs in reversed(self.sizes):
            inp.pad_decode(0, bs)
            self.graphs[bs], self.outputs[bs] = self._capture_one(bs, self._meta(bs))
        torch.cuda.synchronize()
        seconds = self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (decode batch 1..%d, mixed steps of %s tokens) in %.2f s",
                    len(self.sizes) + len(self.mixed_sizes), self.sizes[-1],
                    f"{self.mixed_sizes[0]}..{self.mixed_sizes[-1]}" if self.mixed_sizes else "no", seconds)
        return seconds

    def _capture_one(self, num_tokens: int, meta) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        inp = self.inputs
        for _ in range(2):  # warm-up outside the graph (autotuning, lazy allocations)
            self.model(inp.input_ids[:num_tokens], inp.positions[:num_tokens], meta)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(inp.input_ids[:num_tokens], inp.positions[:num_tokens], meta)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def padded_size(self, num_reqs: int) -> int | None:
        for size in self.sizes:
            if size >= num_reqs:
                return size
        return None

    def mixed_size(self, num_tokens: int, num_reqs: int) -> int | None:
        """The mixed graph for a step of num_tokens tokens over num_reqs requests, if one covers it."""
        if num_reqs > self.mixed_reqs:
            return None
        return next((t for t in self.mixed_sizes if t >= num_tokens), None)

    def replay_mixed(self, num_tokens: int, num_reqs: int) -> torch.Tensor:
        """Inputs of a mixed step are already in the buffers; returns the hidden states of its num_tokens tokens."""
        t = self.mixed_size(num_tokens, num_reqs)
        self.inputs.pad_mixed(num_tokens, num_reqs, t, self.mixed_reqs)
        self.mixed_graphs[t].replay()
        return self.mixed_outputs[t][:num_tokens]

    def replay(self, num_reqs: int) -> torch.Tensor:
        """Inputs for num_reqs decode rows are already in the buffers; returns their hidden states."""
        bs = self.padded_size(num_reqs)
        self.inputs.pad_decode(num_reqs, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:num_reqs]
