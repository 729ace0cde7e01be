"""Capture sizes cover every batch up to max_num_seqs with bounded padding; the replay test needs CUDA."""
from __future__ import annotations

import time

import pytest
import torch

from surge.worker.cuda_graph import capture_sizes


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 7, 8, 9, 128, 255, 256, 257, 300, 512])
def test_capture_sizes_cover_every_batch(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs and sizes[0] == 1
    for n in range(1, max_num_seqs + 1):
        padded = min(s for s in sizes if s >= n)
        assert padded - n < 16  # at most one step of padding


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager():
    from surge.bench.common import run_engine
    from surge.engine.args import EngineArgs
    from surge.engine.core import EngineCore

    def engine(enforce_eager: bool) -> EngineCore:
        return EngineCore(EngineArgs(preset="tiny-qwen3-hybrid", load_format="dummy", device="cuda",
                                     enforce_eager=enforce_eager, max_num_seqs=16,
                                     max_model_len=512).create_engine_config())

    # Mixed lengths, more requests than some capture sizes: padding rows must not disturb real ones.
    workload = [([100 + i] * (5 + 7 * i), 24) for i in range(11)]
    graphs = engine(False)
    assert graphs.executor.runner.graph_runner is not None
    assert run_engine(engine(True), workload, show_progress=False) == run_engine(graphs, workload,
                                                                                 show_progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_background_capture_serves_while_capturing_and_matches_eager():
    """Start-up captures nothing; the kernel warm-up and every capture wait for the first step's launch, then land
    while requests run (steps before theirs run eagerly or replay a larger graph). The tokens equal an eager
    engine's, during the capture and after it, and every graph is there in the end. An engine that gets no step
    captures after idling a second; a shutdown before or during the capture stops it."""
    from surge.bench.common import run_engine
    from surge.engine.args import EngineArgs
    from surge.engine.core import EngineCore

    def engine(**kw) -> EngineCore:
        return EngineCore(EngineArgs(preset="tiny-qwen3-hybrid", load_format="dummy", device="cuda",
                                     max_num_seqs=64, max_model_len=512, kv_cache_memory=1 << 28,
                                     **kw).create_engine_config())

    workload = [([100 + i] * (5 + 7 * i), 24) for i in range(11)]
    expected = run_engine(engine(enforce_eager=True), workload, show_progress=False)
    bg = engine(cuda_graph_capture="background")
    graphs = bg.executor.runner.graph_runner
    time.sleep(0.3)
    assert not graphs.graphs and not graphs.mixed_graphs  # the thread waits for the first step
    during = run_engine(bg, workload, show_progress=False)
    assert graphs.wait(120) and graphs.background_seconds > 0
    assert sorted(graphs.graphs) == graphs.sizes and sorted(graphs.mixed_graphs) == graphs.mixed_sizes
    assert during == expected
    assert run_engine(bg, workload, show_progress=False) == expected
    bg.shutdown()

    idle = engine(cuda_graph_capture="background")
    graphs = idle.executor.runner.graph_runner
    assert graphs.wait(120) and sorted(graphs.graphs) == graphs.sizes  # no step came: captured after the idle second
    assert run_engine(idle, workload, show_progress=False) == expected
    idle.shutdown()

    stopped = engine(cuda_graph_capture="background")
    stopped.shutdown()  # joins the capture thread (waiting, or after its graph in progress)
    assert not stopped.executor.runner.graph_runner.capturing


def test_cuda_graph_capture_mode_is_checked():
    from surge.engine.args import EngineArgs

    with pytest.raises(ValueError, match="cuda_graph_capture='later' must be one of background, startup"):
        EngineArgs(preset="tiny-llama", load_format="dummy", device="cpu",
                   cuda_graph_capture="later").create_engine_config()
