"""The EngineCore in its own process: a busy loop fed over ZMQ (msgspec msgpack, no pickle), and CoreClient,
the front end's handle on that process (start-up, send, receive, death detection, shutdown).

The loop blocks on its input socket while idle. A failed step fails every in-flight request instead of hanging
it; the child exits when its parent dies, and the parent watches the child's sentinel to notice a crash.
"""
from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from surge.config import EngineConfig
from surge.engine.messages import (AbortRequests, AddRequest, CoreReady, CoreRequest, EngineCoreOutputs,
                                   RequestFailure, Shutdown, StopRequests, UtilityCall, UtilityResult)
from surge.core.request import Request, RequestStatus
from surge.logger import init_logger
from surge.worker.executor import WorkerDiedError

logger = init_logger(__name__)

# How often an idle core looks up whether its parent is still alive.
_PARENT_CHECK_MS = 1000

UTILITY_METHODS: dict[str, Callable] = {
    "get_stats": lambda engine: engine.get_stats(),
    "reset_prefix_cache": lambda engine: engine.kv_cache_manager.reset_prefix_cache(),
    "remove_lora": lambda engine, lora_int_id: engine.remove_lora(lora_int_id),
}


class EngineDeadError(RuntimeError):
    """The engine core process is gone; nothing it held will finish."""


class EngineCoreProc:
    """The loop body, apart from process set-up so tests can drive it with any engine and sockets."""

    def __init__(self, engine, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: int | None) -> None:
        self.engine = engine
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self.block_size = engine.config.cache_config.block_size
        self._decoder = msgspec.msgpack.Decoder(CoreRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._failures: list[RequestFailure] = []
        self._utility_results: list[UtilityResult] = []
        self._last_stats = None
        self._shutdown = False
        self._fatal: BaseException | None = None

    def run(self) -> None:
        while not self._shutdown:
            if not self._wait_for_input(block=not self.engine.has_unfinished_requests()):
                logger.warning("the front end process is gone; the engine core exits")
                return
            self._drain_input()
            if self._shutdown:
                return
            outputs = self._step() if self.engine.has_unfinished_requests() else []
            self._send(outputs)
            if self._fatal is not None:
                raise self._fatal

    def _parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def _wait_for_input(self, block: bool) -> bool:
        """Block until a message arrives (idle) or just check the parent (busy). False once the parent is gone."""
        while block and not self.input.poll(_PARENT_CHECK_MS):
            if not self._parent_alive():
                return False
        return self._parent_alive()

    def _drain_input(self) -> None:
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(self._decoder.decode(frame))
            except msgspec.DecodeError as e:  # a malformed message must not take the loop down
                logger.error("dropping a malformed message to the engine core: %s", e)

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(Request(msg.request_id, msg.prompt_token_ids, msg.params, self.block_size,
                                                pooling_params=msg.pooling_params, lora_request=msg.lora_request,
                                                mm_features=msg.mm_features))
            except ValueError as e:
                self._failures.append(RequestFailure(msg.request_id, str(e), invalid_request=True))
        elif isinstance(msg, AbortRequests):
            self.engine.abort_requests(msg.request_ids)
        elif isinstance(msg, StopRequests):
            self.engine.finish_requests(msg.request_ids, RequestStatus.FINISHED_STOPPED)
        elif isinstance(msg, UtilityCall):
            method = UTILITY_METHODS.get(msg.method)
            if method is None:
                self._utility_results.append(UtilityResult(msg.call_id, error=f"unknown utility {msg.method!r}; "
                                                                              f"known: {sorted(UTILITY_METHODS)}"))
            else:
                try:
                    self._utility_results.append(UtilityResult(msg.call_id, result=method(self.engine, *msg.args)))
                except Exception as e:
                    self._utility_results.append(UtilityResult(msg.call_id, error=f"{type(e).__name__}: {e}"))
        elif isinstance(msg, Shutdown):
            self._shutdown = True

    def _step(self) -> list:
        try:
            return self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing every in-flight request")
            # If this fails too, the exception ends the process, and the front end fails everything it holds.
            request_ids = self.engine.request_ids()
            self.engine.abort_requests(request_ids)
            message = f"the engine failed while running this request ({type(e).__name__}: {e})"
            self._failures.extend(RequestFailure(rid, message, invalid_request=False) for rid in request_ids)
            if isinstance(e, WorkerDiedError):  # a lost rank cannot come back: report, then end the process
                self._fatal = e
            return []

    def _send(self, outputs: list) -> None:
        """Send outputs, failures and utility results; stats too whenever they changed (so gauges are current
        after an abort even when no step follows)."""
        stats = self.engine.get_stats()
        if not (outputs or self._failures or self._utility_results or stats != self._last_stats):
            return
        self._last_stats = stats
        msg = EngineCoreOutputs(outputs=outputs, stats=stats, failures=self._failures,
                                utility_results=self._utility_results)
        self._failures, self._utility_results = [], []
        self.output.send(self._encoder.encode(msg))


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int, ready_pipe) -> None:
    """Entry point of the engine core process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which shuts this process down
    encoder = msgspec.msgpack.Encoder()
    try:
        from surge.engine.core import EngineCore
        engine = EngineCore(config)
    except BaseException as e:
        ready_pipe.send_bytes(encoder.encode(CoreReady(error=f"{type(e).__name__}: {e}")))
        raise SystemExit(1) from None
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.connect(input_addr)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.connect(output_addr)
    ready_pipe.send_bytes(encoder.encode(CoreReady(num_kv_blocks=engine.executor.kv_cache_config.num_blocks)))
    ready_pipe.close()
    try:
        EngineCoreProc(engine, input_socket, output_socket, parent_pid).run()
    finally:
        input_socket.close(linger=0)
        output_socket.close(linger=1000)  # let the last outputs reach the front end
        ctx.term()


class CoreClient:
    """Starts the engine core process and talks to it. Construct it outside or inside an event loop; `send` and
    `recv` are coroutines. `on_death` is called once (from the loop) when the process exits unexpectedly."""

    def __init__(self, config: EngineConfig, startup_timeout: float = 900.0) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="surge-core-")
        input_addr, output_addr = f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output"
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(output_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._closing = False
        self._watching: asyncio.AbstractEventLoop | None = None
        self.dead_error: EngineDeadError | None = None
        mp = multiprocessing.get_context("spawn")
        reader, writer = mp.Pipe(duplex=False)
        # Not a daemon: the core may start worker processes of its own. Shutdown is explicit (and at exit).
        self.proc = mp.Process(target=run_engine_core, name="surge-engine-core",
                               args=(config, input_addr, output_addr, os.getpid(), writer))
        self.proc.start()
        writer.close()
        atexit.register(self.shutdown)
        try:
            self.ready = self._wait_ready(reader, startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        finally:
            reader.close()

    def _wait_ready(self, reader, timeout: float) -> CoreReady:
        deadline = time.monotonic() + timeout
        while not reader.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process exited during start-up (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start within {timeout:.0f} s")
        try:
            ready = msgspec.msgpack.decode(reader.recv_bytes(), type=CoreReady)
        except EOFError:
            raise RuntimeError(f"the engine core process exited during start-up "
                               f"(exit code {self.proc.join(5) or self.proc.exitcode})") from None
        if ready.error is not None:
            raise RuntimeError(f"the engine core failed to start: {ready.error}")
        return ready

    def watch(self, on_death: Callable[[EngineDeadError], None]) -> None:
        """Call on_death from the running loop when the process exits without being asked to."""
        loop = asyncio.get_running_loop()
        if self._watching is not None and not self._watching.is_closed():
            self._watching.remove_reader(self.proc.sentinel)
        self._watching = loop

        def exited() -> None:
            loop.remove_reader(self.proc.sentinel)
            if self._closing:
                return
            self.proc.join(1)
            self.dead_error = EngineDeadError(f"the engine core process died (exit code {self.proc.exitcode})")
            logger.error("%s", self.dead_error)
            on_death(self.dead_error)

        loop.add_reader(self.proc.sentinel, exited)

    async def send(self, msg) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        await self._input.send(self._encoder.encode(msg))

    async def recv(self) -> EngineCoreOutputs:
        return self._decoder.decode(await self._output.recv())

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        if self.proc.is_alive():
            try:  # a plain socket shadowing the async one: shutdown may run outside any event loop
                zmq.Socket.shadow(self._input.underlying).send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
