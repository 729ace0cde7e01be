"""The engine core's loop (engine/core_proc.py) driven over real ZMQ sockets with a scripted engine: a failed step
fails every in-flight request, an idle loop blocks instead of spinning, malformed messages are dropped, and the
loop ends when told to or when its parent is gone."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from surge.engine.core import EngineCoreOutput, SchedulerStats
from surge.engine.core_proc import EngineCoreProc
from surge.engine.messages import (AbortRequests, AddRequest, EngineCoreOutputs, Shutdown, StopRequests,
                                   UtilityCall)
from surge.core.request import RequestStatus
from surge.sampling_params import SamplingParams


class ScriptedEngine:
    """Stands in for EngineCore: holds request ids; step() fails while `fail` is set, else finishes them all."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(cache_config=SimpleNamespace(block_size=4), device=None)
        self.requests: list[str] = []
        self.fail = False
        self.calls: list[str] = []
        self.aborted: list[str] = []
        self.stopped: list[str] = []

    def add_request(self, request) -> None:
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.requests.append(request.request_id)

    def abort_requests(self, ids) -> None:
        self.aborted += ids
        self.requests = [r for r in self.requests if r not in ids]

    def finish_requests(self, ids, status) -> None:
        assert status == RequestStatus.FINISHED_STOPPED
        self.stopped += ids
        self.requests = [r for r in self.requests if r not in ids]

    def has_unfinished_requests(self) -> bool:
        self.calls.append("has_unfinished")
        return bool(self.requests)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.requests), 0, 0.5 if self.requests else 0.0, 0, 0, 0)

    def step(self):
        if isinstance(self.fail, BaseException):
            raise self.fail
        if self.fail:
            raise RuntimeError("boom")
        done, self.requests = self.requests, []
        return [EngineCoreOutput(rid, [7], finish_reason="length") for rid in done]


@pytest.fixture
def loop():
    ctx = zmq.Context()
    to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_in.bind("inproc://in")
    to_core.connect("inproc://in")
    from_core.bind("inproc://out")
    core_out.connect("inproc://out")
    engine = ScriptedEngine()
    proc = EngineCoreProc(engine, core_in, core_out, parent_pid=None)
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutputs)

    def send(msg) -> None:
        to_core.send(msg if isinstance(msg, bytes) else encoder.encode(msg))

    def recv(timeout_ms: int = 5000) -> EngineCoreOutputs:
        assert from_core.poll(timeout_ms), "the core loop sent nothing"
        return decoder.decode(from_core.recv())

    def recv_utility() -> list:
        while not (out := recv()).utility_results:
            pass  # stats-only messages
        return out.utility_results

    yield SimpleNamespace(engine=engine, send=send, recv=recv, recv_utility=recv_utility, thread=thread)
    send(Shutdown())
    thread.join(5)
    assert not thread.is_alive(), "the loop did not stop on Shutdown"
    for s in (to_core, core_in, core_out, from_core):
        s.close(linger=0)
    ctx.term()


def _add(rid: str, tokens=(1, 2, 3)) -> AddRequest:
    return AddRequest(rid, list(tokens), SamplingParams(max_tokens=4))


def test_outputs_flow_and_stats_follow(loop):
    loop.send(_add("a"))
    out = loop.recv()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in out.outputs] == [("a", [7], "length")]
    assert out.stats.num_running == 0 and out.stats.kv_cache_usage == 0.0


def test_failed_step_fails_every_in_flight_request(loop):
    loop.engine.fail = True
    loop.send(_add("a"))
    loop.send(_add("b"))
    failures = []
    while len(failures) < 2:
        failures += loop.recv().failures
    assert sorted(f.request_id for f in failures) == ["a", "b"]
    assert all(not f.invalid_request and "boom" in f.message for f in failures)
    assert sorted(loop.engine.aborted) == ["a", "b"]  # their KV blocks are freed
    loop.engine.fail = False
    loop.send(_add("c"))  # and the loop goes on serving
    assert [o.request_id for o in loop.recv().outputs] == ["c"]


def test_lost_rank_fails_requests_then_ends_the_loop():
    """A dead tensor-parallel rank cannot come back: the loop reports the in-flight requests, then raises."""
    from surge.worker.executor import WorkerDiedError

    ctx = zmq.Context()
    to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_in.bind("inproc://in-dead")
    to_core.connect("inproc://in-dead")
    from_core.bind("inproc://out-dead")
    core_out.connect("inproc://out-dead")
    engine = ScriptedEngine()
    engine.fail = WorkerDiedError("tensor-parallel rank 1 (pid 123) was killed by SIGKILL")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            EngineCoreProc(engine, core_in, core_out, parent_pid=None).run()
        except BaseException as e:  # the thread's exit reason is what the test checks
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    to_core.send(msgspec.msgpack.encode(_add("a")))
    thread.join(5)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], WorkerDiedError)
    assert from_core.poll(1000)
    out = msgspec.msgpack.Decoder(EngineCoreOutputs).decode(from_core.recv())
    assert [f.request_id for f in out.failures] == ["a"] and "rank 1" in out.failures[0].message
    for sock in (to_core, core_in, core_out, from_core):
        sock.close(linger=0)
    ctx.term()


def test_refused_request_is_an_invalid_request_failure(loop):
    loop.send(_add("empty", tokens=()))
    out = loop.recv()
    assert [(f.request_id, f.invalid_request) for f in out.failures] == [("empty", True)]


def test_abort_and_stop_reach_the_engine_and_update_stats(loop):
    loop.engine.requests = ["x", "y"]  # as if running; the loop is idle-blocked until a message arrives
    loop.send(AbortRequests(["x"]))
    loop.send(StopRequests(["y"]))
    deadline = time.monotonic() + 5
    while (loop.engine.aborted, loop.engine.stopped) != (["x"], ["y"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (loop.engine.aborted, loop.engine.stopped) == (["x"], ["y"])


def test_utilities_and_malformed_messages(loop):
    loop.send(b"\x93not a message")
    loop.send(UtilityCall(1, "get_stats"))
    [result] = loop.recv_utility()
    assert result.call_id == 1 and msgspec.convert(result.result, SchedulerStats).num_running == 0
    loop.send(UtilityCall(2, "format_disk"))
    [result] = loop.recv_utility()
    assert result.call_id == 2 and "unknown utility" in result.error


def test_idle_loop_blocks_instead_of_spinning(loop):
    loop.send(_add("a"))
    loop.recv()
    time.sleep(0.1)
    before = len(loop.engine.calls)
    time.sleep(0.6)
    assert len(loop.engine.calls) - before <= 2  # blocked on the socket, not polling in a loop


def test_loop_exits_when_parent_is_gone():
    ctx = zmq.Context()
    core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    core_in.bind("inproc://orphan")
    proc = EngineCoreProc(ScriptedEngine(), core_in, core_out, parent_pid=-1)  # no process has this parent id
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()
    core_in.close(linger=0)
    core_out.close(linger=0)
    ctx.term()
