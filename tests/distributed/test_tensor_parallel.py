"""Tensor parallelism end to end on CPU (gloo): worker processes, shared-memory steps, sharded weights. The
reference is the same engine on one rank, in process: greedy and seeded outputs must be token-identical, logprobs
close, through chunked prefill, prefix-cache hits and preemption; so must a two-node launch on this machine."""
from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys

import pytest
import torch

from surge import LLM, SamplingParams
from engine_steps import abort_while_in_flight
from tiny_models import make_tiny_model

ENGINE = dict(block_size=4, max_model_len=128, device="cpu", max_num_batched_tokens=24)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 256, (18,), generator=g).tolist()  # prefix-cache hits for the later ones
    return [shared + [7, 8], torch.randint(3, 256, (40,), generator=g).tolist(), shared + [9], [5, 6, 7]]


def _params() -> list[SamplingParams]:
    return [GREEDY,
            GREEDY.clone(logprobs=3, prompt_logprobs=2),
            SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True),
            GREEDY.clone(repetition_penalty=1.3, frequency_penalty=0.5)]


def _generate(model_dir, tp: int, **kwargs):
    llm = LLM(model_dir, tensor_parallel_size=tp, **{**ENGINE, **kwargs})
    try:
        out = llm.generate(_prompts(), _params(), use_tqdm=False)
        return out, llm.engine.scheduler.num_preemptions
    finally:
        llm.engine.shutdown()


def _assert_same(out, ref) -> None:
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    lp, ref_lp = out[1].outputs[0].logprobs, ref[1].outputs[0].logprobs
    assert [list(d) for d in lp] == [list(d) for d in ref_lp]  # the same top tokens, in the same order
    for d, r in zip(lp, ref_lp):
        for tok in d:
            assert d[tok].logprob == pytest.approx(r[tok].logprob, abs=1e-4)
    plp, ref_plp = out[1].prompt_logprobs, ref[1].prompt_logprobs
    assert len(plp) == len(ref_plp) == len(_prompts()[1])
    for d, r in zip(plp[1:], ref_plp[1:]):
        assert list(d) == list(r)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3-hybrid", "llama-mqa"])
def test_tp2_matches_one_rank(kind, tmp_path):
    model_dir = make_tiny_model(kind, tmp_path / kind)
    ref, _ = _generate(model_dir, 1, kv_cache_memory=1 << 22)
    out, _ = _generate(model_dir, 2, kv_cache_memory=1 << 22)
    _assert_same(out, ref)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_moe_tp2_and_ep2_match_one_rank(expert_parallel, tmp_path):
    """Qwen3-MoE over two ranks: a slice of every expert each (TP), or half the experts each (EP); attention is
    tensor-parallel both ways. Through prefix-cache hits and, with few blocks, preemption."""
    model_dir = make_tiny_model("qwen3-moe", tmp_path / "moe")
    ref, _ = _generate(model_dir, 1, kv_cache_memory=1 << 22)
    out, _ = _generate(model_dir, 2, kv_cache_memory=1 << 22, enable_expert_parallel=expert_parallel)
    _assert_same(out, ref)
    ref, ref_preemptions = _generate(model_dir, 1, num_gpu_blocks_override=13, max_model_len=48)
    out, preemptions = _generate(model_dir, 2, num_gpu_blocks_override=13, max_model_len=48,
                                 enable_expert_parallel=expert_parallel)
    assert ref_preemptions > 0 and preemptions == ref_preemptions
    _assert_same(out, ref)


def test_expert_parallel_flag_reaches_the_ranks(tmp_path):
    """--enable-expert-parallel -> EngineArgs -> ParallelConfig -> each rank's expert-parallel group (the TP ranks)."""
    import argparse

    from surge.config import ParallelConfig
    from surge.distributed.parallel_state import destroy_distributed, get_ep_group, get_tp_group, init_distributed
    from surge.engine.args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--enable-expert-parallel", "-tp", "2", "--device", "cpu"]))
    config = dataclasses.replace(args, model=make_tiny_model("qwen3-moe", tmp_path / "m")).create_engine_config()
    assert config.parallel_config.enable_expert_parallel and config.parallel_config.expert_parallel_size == 2
    for enabled in (True, False):
        init_distributed(ParallelConfig(enable_expert_parallel=enabled, master_port=_free_port()), 0,
                         torch.device("cpu"))
        try:
            assert (get_ep_group() is get_tp_group()) == enabled
        finally:
            destroy_distributed()
    assert get_ep_group().world_size == 1


def test_tp2_through_preemption(tmp_path):
    """So few KV blocks that requests are preempted and recomputed: the workers' request cache must follow."""
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    ref, ref_preemptions = _generate(model_dir, 1, num_gpu_blocks_override=13, max_model_len=48)
    out, preemptions = _generate(model_dir, 2, num_gpu_blocks_override=13, max_model_len=48)
    assert ref_preemptions > 0 and preemptions == ref_preemptions
    _assert_same(out, ref)


@pytest.mark.parametrize("tp", [2, 3])
def test_default_model(default_model_dir, tp):
    """The default model has 9 heads and 3 KV heads: tp=2 splits the KV heads 2 + 1 (query heads 6 + 3)."""
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(max_model_len=128, kv_cache_memory=8 << 20, device="cpu")
    ref = LLM(default_model_dir, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(default_model_dir, tensor_parallel_size=tp, **kwargs)
    try:
        out = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_machine(tmp_path):
    """nnodes=2, one rank each: node 1 is `surge generate --node-rank 1` (headless), node 0 this process."""
    model_dir = make_tiny_model("qwen3-hybrid", tmp_path / "m")
    ref, _ = _generate(model_dir, 1, kv_cache_memory=1 << 22)
    port = _free_port()
    node1 = subprocess.Popen([sys.executable, "-m", "surge.entrypoints.cli.main", "generate", "--model", str(model_dir),
                              "--device", "cpu", "--block-size", "4", "--max-model-len", "128",
                              "--kv-cache-memory", str(1 << 22), "--max-num-batched-tokens", "24",
                              "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                              "--master-addr", "127.0.0.1", "--master-port", str(port)], stdin=subprocess.DEVNULL)
    try:
        out, _ = _generate(model_dir, 2, kv_cache_memory=1 << 22, nnodes=2, node_rank=0, master_port=port)
        assert node1.wait(timeout=30) == 0  # node 0's shutdown reached node 1 through the relay
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    _assert_same(out, ref)


def _count_overlapped_launches(llm) -> list[int]:
    """Wrap the executor: one entry per step launched while the step before was still in flight."""
    engine = llm.engine
    overlapped: list[int] = []
    inner = engine.executor.execute_async

    def launch(out):
        if engine._in_flight is not None:
            overlapped.append(len(out.scheduled))
        return inner(out)

    engine.executor.execute_async = launch
    return overlapped


@pytest.mark.parametrize("blocks", [None, 13], ids=["plain", "preempted"])
def test_tp2_async_scheduling_matches_one_rank(tmp_path, blocks):
    """Async scheduling under tensor parallelism: each rank takes the token the step before sampled from its own
    device (rank 0 broadcasts it), so step N+1 runs before step N's tokens reach the host; output identical."""
    model_dir = make_tiny_model("qwen3-hybrid", tmp_path / "m")
    params = [GREEDY, GREEDY.clone(logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True), GREEDY]
    memory = dict(num_gpu_blocks_override=blocks, max_model_len=48) if blocks else dict(kv_cache_memory=1 << 22)
    ref_llm = LLM(model_dir, **{**ENGINE, **memory})
    ref = ref_llm.generate(_prompts(), params, use_tqdm=False)
    llm = LLM(model_dir, tensor_parallel_size=2, async_scheduling=True, **{**ENGINE, **memory})
    try:
        assert llm.engine.async_scheduling
        overlapped = _count_overlapped_launches(llm)
        out = llm.generate(_prompts(), params, use_tqdm=False)
        assert len(overlapped) > 5  # the steps really overlapped
        if blocks:
            assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()
    _assert_same(out, ref)


def test_tp2_async_abort_mid_flight(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "m")
    alone = LLM(model_dir, **{**ENGINE, "kv_cache_memory": 1 << 22}).generate([[9, 8, 7]], GREEDY, use_tqdm=False)
    llm = LLM(model_dir, tensor_parallel_size=2, async_scheduling=True, kv_cache_memory=1 << 22, **ENGINE)
    try:
        engine = llm.engine
        got = abort_while_in_flight(engine, GREEDY)
        assert got["b"] == alone[0].outputs[0].token_ids and len(got["a"]) < 12
        assert engine.kv_cache_manager.usage == 0.0
        # The ranks still serve after the abort: the same request again gives the same tokens.
        again = llm.generate([[9, 8, 7]], GREEDY, use_tqdm=False)
        assert again[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    finally:
        llm.engine.shutdown()
