"""CUDA graphs: one per decode batch size up to max_num_seqs, and one per token count for small mixed steps (prefill
chunks, with or without decodes), all sharing one memory pool.

A decode step with n requests replays the smallest graph of size >= n, its extra rows padded into the null block. A
mixed step of t tokens replays the smallest mixed graph of >= t tokens, shaped for max_num_seqs requests: its
padding tokens belong to no request and its padding requests have no tokens (StepInputs.pad_mixed). Such steps are
short on the device (a follow-up turn on a long cached prefix, a short prompt) and were bound by the host launching
~10 kernels per layer one by one; as a graph they launch once. The attention kernel reads every length from device
memory and sizes its grid by token and request capacity, so one capture serves every layout. Graphs capture views of
StepInputs' persistent buffers, so a replay only needs those buffers filled.

With `cuda_graph_capture="background"` start-up captures none (`capture_in_background`): once the engine's first
step is launched (a restart's first request: it runs eagerly), or after a second with none, a thread runs the kernel
warm-up and captures the graphs one by one while the engine serves. Each graph serves from the moment it is
published; until then a step runs eagerly, or replays a larger graph. The thread never runs the model: a capture
records launches without executing them, so it reads no buffer the engine is filling and writes no KV; it captures
in CUDA's thread-local mode, so the engine's own calls (allocations, synchronizations) on other streams stay legal
meanwhile. Under tensor parallelism every graph is captured at start-up: a capture records collectives, whose order
must match across ranks. What the thread cannot survive is a device-wide synchronize in its process (CUDA refuses it
during any capture, and the capture is lost): the engine never makes one, which is why background capture is the
default only where the process runs nothing but the engine (`surge serve`). A failed capture leaves the remaining
steps eager, and is logged.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

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


# Token counts of the mixed graphs. Above the largest, the device's time dominates the host's launches. Steps of a
# few tokens per request are common (a verification of k drafts: k + 1 each; a short follow-up turn), and padding
# them far costs compute: on the H200 a k = 4 verification at batch 1 (5 tokens) padded to 128 took 1.34x a decode
# step, and 160 tokens padded to 256 1.67x. Multiples of 16 only, so every size is the same Triton specialization
# of the token count as the kernel warm-up's. Each is ~40 ms of capture at 8B (in the background under serve).
MIXED_SIZES = (16, 32, 64, 128, 192, 256, 384, 512)


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    return [t for t in MIXED_SIZES if t <= max_num_batched_tokens]


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, inputs: StepInputs, backend: AttentionBackend, max_num_seqs: int,
                 max_model_len: int, lora_mapping=None) -> None:
        """lora_mapping: a LoRA engine's step mapping (surge/model/layers/lora.py): the decode graphs are captured
        twice, with the LoRA kernels (steps carrying adapters) and without (steps of the base model alone, which
        then run as fast as in an engine without LoRA; vLLM's cudagraph_specialize_lora)."""
        self.model = model
        self.lora_mapping = lora_mapping
        self.base_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode, without the LoRA kernels
        self.base_outputs: dict[int, torch.Tensor] = {}
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
        self.capture_seconds = 0.0  # start-up's share (all of it without a background thread)
        self.background_seconds = 0.0  # the thread's, once it has finished
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _meta(self, bs: int):
        # Capacity-shaped metadata: kernels read lengths from the tensors, never from these host values.
        return self.inputs.metadata(self.backend, bs, bs, list(range(bs + 1)), [], max_query_len=1,
                                    max_seq_len=self.max_model_len, for_capture=True)

    def _mixed_meta(self, num_tokens: int):
        return self.inputs.metadata(self.backend, num_tokens, self.mixed_reqs, list(range(self.mixed_reqs + 1)), [],
                                    max_query_len=num_tokens, max_seq_len=self.max_model_len, for_capture=True)

    def _plan(self) -> list[tuple[str, int]]:
        """Every graph, largest first (later ones reuse its pool memory): mixed token counts, then decode batches
        (a LoRA engine's: then the decode batches again, without the LoRA kernels)."""
        decode = list(reversed(self.sizes))
        base = [("base", bs) for bs in decode] if self.lora_mapping is not None else []
        return [("mixed", t) for t in reversed(self.mixed_sizes)] + [("decode", bs) for bs in decode] + base

    def capture(self) -> float:
        """Capture every graph now."""
        start = time.perf_counter()
        plan = self._plan()
        # Memory a collected engine left cached is of no use to the graphs' own pool, and no capture can give it
        # back to the driver (torch.cuda.graph empties the cache before every capture; once is enough).
        torch.cuda.empty_cache()
        self._capture_all(plan, warm_first=True)
        seconds = self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (%s) in %.2f s", len(plan), self._describe(), seconds)
        return seconds

    def capture_in_background(self, prepare: Callable[[], object] | None = None,
                              after: threading.Event | None = None, idle_seconds: float = 1.0) -> None:
        """Capture every graph on a thread, each serving once published: `prepare` (the kernel warm-up) first,
        and both only once `after` is set (the engine's first step is launched) or `idle_seconds` passed without
        it. background_seconds counts the thread's time from then on."""
        plan = self._plan()
        device = self.inputs.input_ids.device

        def run() -> None:
            deadline = time.monotonic() + idle_seconds
            while after is not None and not after.is_set() and time.monotonic() < deadline:
                if self._stop.wait(0.01):
                    return
            start = time.perf_counter()
            try:
                if prepare is not None:
                    prepare()
                torch.cuda.set_device(device)
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):  # this thread's cuBLAS handle and workspace, before any capture
                    w = torch.ones(64, 64, device=device, dtype=self.model_dtype)
                    torch.nn.functional.linear(w, w, w[0]).sum().item()
                done = self._capture_all(plan, warm_first=False, stream=stream)
            except BaseException:  # the engine serves on: a step without its graph runs eagerly
                logger.exception("background CUDA graph capture failed; the steps it did not cover run eagerly")
                return
            self.background_seconds = time.perf_counter() - start
            logger.info("captured %d CUDA graphs in the background in %.2f s (%s)", done, self.background_seconds,
                        self._describe())

        self._thread = threading.Thread(target=run, name="surge-graph-capture", daemon=True)
        self._thread.start()

    @property
    def capturing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background capture, if any, is done; False if it still runs after `timeout`."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.capturing

    def stop(self) -> None:
        """End the background capture after the graph in progress (the engine is shutting down)."""
        self._stop.set()
        self.wait()

    @property
    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _describe(self) -> str:
        mixed = sorted(self.mixed_graphs)
        base = f"; decode 1..{max(self.base_graphs)} again without the LoRA kernels" if self.base_graphs else ""
        return (f"decode batch 1..{max(self.graphs, default=0)}, mixed steps of "
                f"{f'{mixed[0]}..{mixed[-1]}' if mixed else 'no'} tokens{base}")

    @torch.inference_mode()
    def _capture_all(self, plan: list[tuple[str, int]], warm_first: bool,
                     stream: torch.cuda.Stream | None = None) -> int:
        """Capture `plan` in order on `stream` (a new side stream by default), publishing each graph as it is done.
        Only start-up's first capture runs the model first (twice: autotuning, lazy allocations); every kernel
        variant was compiled by the kernel warm-up, so later captures need no run. Unlike torch.cuda.graph, no
        capture synchronizes the device or empties the caching allocator (its blocks serve the next capture).
        Returns how many were captured."""
        inp = self.inputs
        stream = stream or torch.cuda.Stream(inp.input_ids.device)
        done = 0
        for i, (kind, n) in enumerate(plan):
            if self._stop.is_set():
                break
            warm = 2 if warm_first and i == 0 else 0
            if kind == "mixed":
                if warm:
                    inp.pad_mixed(0, 0, n, self.mixed_reqs)
                graph, out = self._capture_one(n, self._mixed_meta(n), warm, stream)
                self.mixed_outputs[n] = out
                self.mixed_graphs[n] = graph  # published: the engine may replay it from now on
            elif kind == "base":  # LoRA engines: the same decode graph without the LoRA kernels
                self.lora_mapping.graph_kernels = False
                try:
                    graph, out = self._capture_one(n, self._meta(n), 0, stream)
                finally:
                    self.lora_mapping.graph_kernels = True
                self.base_outputs[n] = out
                self.base_graphs[n] = graph
            else:
                if warm:
                    inp.pad_decode(0, n)
                graph, out = self._capture_one(n, self._meta(n), warm, stream)
                self.outputs[n] = out
                self.graphs[n] = graph
            done += 1
        stream.synchronize()
        return done

    def _capture_one(self, num_tokens: int, meta, warm: int,
                     stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        inp = self.inputs
        for _ in range(warm):
            self.model(inp.input_ids[:num_tokens], inp.model_positions(num_tokens), meta)
        if warm:
            torch.cuda.current_stream().synchronize()  # not the device: another engine may be capturing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            # Thread-local mode: another thread's allocations do not break this capture (a device-wide
            # synchronize still would: see the module's docstring).
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = self.model(inp.input_ids[:num_tokens], inp.model_positions(num_tokens), meta)
            finally:
                graph.capture_end()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured decode graph of >= num_reqs rows (graphs only ever get added, so a size found
        here is still there at the replay)."""
        graphs = self.graphs
        return next((size for size in self.sizes if size >= num_reqs and size in graphs), None)

    def mixed_size(self, num_tokens: int, num_reqs: int) -> int | None:
        """The mixed graph for a step of num_tokens tokens over num_reqs requests, if one covers it."""
        if num_reqs > self.mixed_reqs:
            return None
        graphs = self.mixed_graphs
        return next((t for t in self.mixed_sizes if t >= num_tokens and t in graphs), None)

    def mixed_padding(self, num_tokens: int, num_reqs: int) -> tuple[int, int] | None:
        """The (tokens, request rows) a mixed step of this size is padded to for its graph, if one covers it."""
        t = self.mixed_size(num_tokens, num_reqs)
        return None if t is None else (t, self.mixed_reqs)

    def replay_mixed(self, num_tokens: int, num_reqs: int) -> torch.Tensor:
        """Inputs of a mixed step are already in the buffers; returns the hidden states of its num_tokens tokens."""
        t = self.mixed_size(num_tokens, num_reqs)
        self.inputs.pad_mixed(num_tokens, num_reqs, t, self.mixed_reqs)
        self.mixed_graphs[t].replay()
        return self.mixed_outputs[t][:num_tokens]

    def replay(self, num_reqs: int, adapters: bool = True) -> torch.Tensor:
        """Inputs for num_reqs decode rows are already in the buffers; returns their hidden states. adapters=False
        (a LoRA engine's step without any): the graph without the LoRA kernels, once captured."""
        bs = self.padded_size(num_reqs)
        self.inputs.pad_decode(num_reqs, bs)
        if not adapters and bs in self.base_graphs:
            self.base_graphs[bs].replay()
            return self.base_outputs[bs][:num_reqs]
        self.graphs[bs].replay()
        return self.outputs[bs][:num_reqs]
