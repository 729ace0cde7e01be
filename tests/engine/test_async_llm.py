"""AsyncLLM with its EngineCore in a separate process, on a tiny random model: streamed deltas add up to what the
offline engine makes, cancelling a stream aborts its request and frees its KV blocks, requests outlive one event
loop, a dead core fails in-flight requests, and the core exits when its parent process dies."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from processes import pid_alive
from surge import LLM, SamplingParams
from surge.engine.async_llm import AsyncLLM, RequestFailedError
from surge.engine.core_proc import EngineDeadError
from surge.engine.output_processor import OutputKind
from tiny_models import make_tiny_model

ENGINE = dict(max_model_len=256, block_size=4, kv_cache_memory=4 << 20)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 101, 102, 103, 104, 105, 106]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def engine(model_dir):
    llm = AsyncLLM.from_engine_args(str(model_dir), **ENGINE)
    yield llm
    llm.core.shutdown()
    assert not llm.core.proc.is_alive()


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_streams_add_up_to_the_offline_outputs(engine, model_dir):
    params = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=12, ignore_eos=True, stop=["zz"])
    offline = LLM(model_dir, **ENGINE).generate(PROMPTS, params, use_tqdm=False)

    async def collect(prompt, request_id):
        texts, tokens, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
        async for out in engine.generate(prompt, params, request_id):
            for c in out.outputs:
                texts[c.index] += c.text
                tokens[c.index] += c.token_ids
                finish[c.index] = c.finish_reason
        return texts, tokens, finish

    async def main():
        return await asyncio.gather(*(collect(p, f"s{i}") for i, p in enumerate(PROMPTS)))

    for (texts, tokens, finish), expected in zip(run(main()), offline):
        for c in expected.outputs:
            assert (texts[c.index], tokens[c.index], finish[c.index]) == (c.text, c.token_ids, c.finish_reason)


def test_final_only_and_cumulative_kinds(engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        final = [o async for o in engine.generate(PROMPTS[0], params, "f", OutputKind.FINAL_ONLY)]
        cumulative = [o async for o in engine.generate(PROMPTS[0], params, "c", OutputKind.CUMULATIVE)]
        return final, cumulative

    final, cumulative = run(main())
    assert len(final) == 1 and final[0].finished and len(final[0].outputs[0].token_ids) == 6
    assert len(cumulative) == 6 and cumulative[-1].outputs[0].token_ids == final[0].outputs[0].token_ids


def test_cancelling_a_stream_aborts_and_frees_kv(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        streams = [engine.generate(p, params, f"cancel-{i}") for i, p in enumerate(PROMPTS)]
        for s in streams:
            await s.__anext__()
        busy = await engine.get_stats()
        for s in streams:
            await s.aclose()
        # A consumer task cancelled while it waits on its stream aborts too.
        task = asyncio.ensure_future(_drain(engine.generate(PROMPTS[0], params, "cancel-task")))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        deadline = time.monotonic() + 10
        while (stats := await engine.get_stats()).num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return busy, stats

    busy, idle = run(main())
    assert busy.num_running + busy.num_waiting > 0 and busy.kv_cache_usage > 0
    assert (idle.num_running, idle.num_waiting, idle.kv_cache_usage) == (0, 0, 0.0)
    assert not engine.output_processor.has_unfinished()


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_refused_request_raises_and_engine_goes_on(engine):
    async def main():
        with pytest.raises(RequestFailedError) as e:
            await _drain(engine.generate([1] * 300, SamplingParams(max_tokens=2), "too-long"))
        assert e.value.invalid_request and "max_model_len" in str(e.value)
        return [o async for o in engine.generate(PROMPTS[1], SamplingParams(max_tokens=2), "after")]

    assert run(main())[-1].finished


def test_dead_core_fails_in_flight_requests(model_dir):
    llm = AsyncLLM.from_engine_args(str(model_dir), **ENGINE)
    try:
        async def main():
            stream = llm.generate(PROMPTS[0], SamplingParams(max_tokens=250, ignore_eos=True), "doomed")
            await stream.__anext__()
            os.kill(llm.core.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await _drain(stream)
            with pytest.raises(EngineDeadError):
                await _drain(llm.generate(PROMPTS[1], SamplingParams(), "after-death"))

        run(main(), timeout=30)
        assert not llm.is_running and "died" in str(llm.dead_error)
    finally:
        llm.core.shutdown()


ORPHAN_SCRIPT = """
import sys, time
from surge.engine.async_llm import AsyncLLM
if __name__ == "__main__":
    llm = AsyncLLM.from_engine_args(sys.argv[1], max_model_len=64, block_size=4, kv_cache_memory=1 << 20)
    print(llm.core.proc.pid, flush=True)
    time.sleep(120)
"""


def test_core_exits_when_its_parent_dies(model_dir, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(ORPHAN_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(model_dir)], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(parent.stdout.readline())
        assert pid_alive(core_pid)
    finally:
        parent.kill()
        parent.wait(10)
    deadline = time.monotonic() + 10
    while pid_alive(core_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(core_pid), "the engine core outlived its parent"
