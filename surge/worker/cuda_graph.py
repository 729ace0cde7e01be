"""CUDA graphs for decode-only steps: one graph per capture size up to max_num_seqs, sharing one memory pool.

A decode step with n requests replays the smallest graph of size >= n, its extra rows padded into the null block.
Graphs capture views of StepInputs' persistent buffers, so a replay only needs those buffers filled.
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
        self.pool = None
        self.capture_seconds = 0.0

    def _meta(self, bs: int):
        # Capacity-shaped metadata: kernels read lengths from the tensors, never from these host values.
        return self.inputs.metadata(self.backend, bs, bs, list(range(bs + 1)), [], max_query_len=1,
                                    max_seq_len=self.max_model_len, for_capture=True)

    @torch.inference_mode()
    def capture(self) -> float:
        start = time.perf_counter()
        inp = self.inputs
        for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            inp.pad_decode(0, bs)
            meta = self._meta(bs)
            for _ in range(2):  # warm-up outside the graph (autotuning, lazy allocations)
                self.model(inp.input_ids[:bs], inp.positions[:bs], meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self.model(inp.input_ids[:bs], inp.positions[:bs], meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        seconds = self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (batch 1..%d) in %.2f s", len(self.sizes), self.sizes[-1], seconds)
        return seconds

    def padded_size(self, num_reqs: int) -> int | None:
        for size in self.sizes:
            if size >= num_reqs:
                return size
        return None

    def replay(self, num_reqs: int) -> torch.Tensor:
        """Inputs for num_reqs decode rows are already in the buffers; returns their hidden states."""
        bs = self.padded_size(num_reqs)
        self.inputs.pad_decode(num_reqs, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:num_reqs]
