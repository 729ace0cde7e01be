"""A decode step with adapters replays a CUDA graph: the graphs capture the LoRA kernels over the mapping's
persistent buffers, so no step falls back to eager launches for carrying adapters. On CPU: the runner's dispatch
sends such steps to the graph runner (a stand-in that runs the forward eagerly), with the same tokens as eager. On
CUDA: graphs against enforce_eager, adapters mixed with the base model, every batch size padded."""
from __future__ import annotations

import pytest
import torch

from surge.bench.common import run_engine
from surge.bench.lora import write_adapter
from surge.engine.args import EngineArgs
from surge.engine.core import EngineCore
from surge.lora_request import LoRARequest


def _engine(device: str, **kw) -> EngineCore:
    return EngineCore(EngineArgs(preset="tiny-llama", load_format="dummy", device=device, enable_lora=True,
                                 max_loras=2, max_lora_rank=8, max_num_seqs=16, max_model_len=256,
                                 kv_cache_memory=1 << 24, **kw).create_engine_config())


def _adapters(engine: EngineCore, root, device) -> list[LoRARequest]:
    mc = engine.config.model_config
    paths = [root / f"a{k}" for k in range(2)]
    for k, path in enumerate(paths):
        write_adapter(path, mc.hf_config, 8, 100 + k, torch.device(device), mc.dtype)
    return [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(paths)]


WORKLOAD = [([100 + i] * (4 + 2 * i), 6) for i in range(5)]


def _loras(adapters):
    return [[adapters[0], None, adapters[1]][i % 3] for i in range(len(WORKLOAD))]


class RecordingGraphs:
    """CUDAGraphRunner's part in the runner's dispatch, on CPU: a graph for every decode batch, run eagerly; it
    records how many adapters each replayed step had."""

    def __init__(self, runner) -> None:
        self.runner, self.replays, self.adapter_flags, self.meta = runner, [], [], None
        prepare = runner.prepare_inputs

        def remember_meta(*args):
            batch = prepare(*args)
            self.meta = batch.meta
            return batch
        runner.prepare_inputs = remember_meta

    def padded_size(self, num_reqs: int) -> int:
        return num_reqs

    def mixed_size(self, num_tokens: int, num_reqs: int) -> None:
        return None

    def mixed_padding(self, num_tokens: int, num_reqs: int) -> None:
        return None

    def replay(self, num_reqs: int, adapters: bool = True) -> torch.Tensor:
        self.replays.append(self.runner.lora.mapping.num_groups)
        self.adapter_flags.append(adapters)
        inputs = self.runner.inputs
        return self.runner.model(inputs.input_ids[:num_reqs], inputs.positions[:num_reqs], self.meta)

    def stop(self) -> None:
        pass


def test_decode_steps_with_adapters_take_the_graph_path(tmp_path):
    engine = _engine("cpu")
    adapters = _adapters(engine, tmp_path, "cpu")
    eager = run_engine(engine, WORKLOAD, show_progress=False, loras=_loras(adapters))
    assert eager != run_engine(engine, WORKLOAD, show_progress=False)  # the adapters change the outputs
    runner = engine.executor.runner
    runner.graph_runner = graphs = RecordingGraphs(runner)
    engine.kv_cache_manager.reset_prefix_cache()
    assert run_engine(engine, WORKLOAD, show_progress=False, loras=_loras(adapters)) == eager
    assert graphs.replays and max(graphs.replays) == 2  # decode steps with both adapters were replayed
    # a step without adapters asks for the graph without the LoRA kernels, a step with some for the other
    assert graphs.adapter_flags == [n > 0 for n in graphs.replays]
    graphs.replays.clear()
    graphs.adapter_flags.clear()
    base = run_engine(engine, WORKLOAD, show_progress=False)  # no adapter at all: the adapter-free graphs
    assert graphs.adapter_flags and not any(graphs.adapter_flags)
    assert base != eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_with_adapters_matches_eager(tmp_path):
    graphs = _engine("cuda")
    runner = graphs.executor.runner
    assert runner.graph_runner is not None and runner.lora.mapping.use_kernels
    replays, adapter_flags = [], []
    replay = runner.graph_runner.replay

    def recording(num_reqs, *args, **kwargs):  # the runner passes whether the step carries adapters too
        replays.append(runner.lora.mapping.num_groups)
        adapter_flags.append(args[0] if args else kwargs.get("adapters", True))
        return replay(num_reqs, *args, **kwargs)
    runner.graph_runner.replay = recording
    adapters = _adapters(graphs, tmp_path, "cuda")
    want = run_engine(_engine("cuda", enforce_eager=True), WORKLOAD, show_progress=False, loras=_loras(adapters))
    assert run_engine(graphs, WORKLOAD, show_progress=False, loras=_loras(adapters)) == want
    assert replays and max(replays) == 2  # decode steps with both adapters were replayed
    # ... from the graphs with the LoRA kernels: a step with adapters never takes the adapter-free ones
    assert adapter_flags == [n > 0 for n in replays]
