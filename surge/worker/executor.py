"""Executors: the one contract EngineCore drives. Each takes a step message (SchedulerOutput), launches it and
returns a handle whose result() is the step's ModelRunnerOutput; launching never waits for an earlier step, so
async scheduling means the same for every executor.

One rank: UniProcExecutor wraps a ModelRunner in the engine's process (no extra process, no serialization).
Tensor parallelism: MultiprocExecutor starts one worker process per local rank (NodeLauncher), writes each step
into a shared-memory ring that every local rank reads, and reads the results that rank 0 writes back in order.
Nodes other than 0 run `run_headless`: their launcher starts their ranks, whose leader relays node 0's steps.

The launcher watches its processes: a rank that dies ends the engine with an error naming it; shutdown (also at
exit, or when the executor is collected) stops every rank.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Protocol

import msgspec
import torch

from surge import envs
from surge.config import EngineConfig
from surge.core.kv_cache.spec import KVCacheConfig
from surge.core.scheduler_output import SchedulerOutput
from surge.distributed.ranks import global_rank
from surge.distributed.shm_broadcast import ShmRing
from surge.logger import init_logger
from surge.worker.model_runner import ModelRunner, ModelRunnerOutput, kv_cache_groups, kv_live_block_caps
from surge.worker.worker import PEER_LOST_EXIT, WorkerArgs, WorkerReady

logger = init_logger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker rank exited: the engine cannot continue (every rank holds part of the model)."""


class StepHandle(Protocol):
    def result(self) -> ModelRunnerOutput:
        """Wait for the step and return what it produced."""


class Executor(Protocol):
    kv_cache_config: KVCacheConfig  # the block count every rank agreed on
    load_seconds: float  # the slowest rank's weight load

    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        """Launch a step; returns at once. Steps complete in the order they were launched."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run a step and wait for its result."""

    @property
    def model(self) -> torch.nn.Module:
        """The model (on the meta device when the weights live in other processes), for reports."""

    def shutdown(self) -> None:
        """Stop whatever the executor started (idempotent)."""


def create_executor(config: EngineConfig) -> Executor:
    if config.parallel_config.in_process:
        return UniProcExecutor(config)
    return MultiprocExecutor(config)


class UniProcExecutor:
    """One rank in the engine's own process: the runner's pending output is the step handle."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        self.kv_cache_config = self.runner.kv_cache_config
        self.load_seconds = self.runner.load_seconds

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        return self.runner.execute_async(out)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(out).result()

    def shutdown(self) -> None:
        if self.runner.graph_runner is not None:
            self.runner.graph_runner.stop()
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == PEER_LOST_EXIT:
        return "lost contact with another rank (a rank on another node died or is unreachable)"
    return f"exited with code {code}"


class NodeLauncher:
    """Starts this node's ranks, waits until each is ready, and watches them."""

    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        self.node_rank, local = pc.node_rank, pc.local_world_size
        self.procs: dict[int, subprocess.Popen] = {}  # global rank -> process
        self._closed = False
        self._failure: WorkerDiedError | None = None
        # Node 0: the driver writes, every local rank reads. Other nodes: the leader writes, the others read.
        readers = local if self.node_rank == 0 else local - 1
        self.step_ring = ShmRing.create(readers) if readers else None
        self.result_ring = ShmRing.create(1, reader=0) if self.node_rank == 0 else None
        ready_fds: dict[int, int] = {}
        try:
            for local_rank in range(local):
                rank = global_rank(self.node_rank, local_rank, local)
                relay = self.node_rank > 0 and local_rank == 0
                ring = None if relay else self.step_ring
                reader = None if relay else (local_rank if self.node_rank == 0 else local_rank - 1)
                read_fd, write_fd = os.pipe()
                ready_fds[rank] = read_fd
                args = WorkerArgs(config=config, rank=rank, local_rank=local_rank, parent_pid=os.getpid(),
                                  ready_fd=write_fd, step_ring=ring.handle if ring else None, step_reader=reader,
                                  relay_ring=self.step_ring.handle if relay and self.step_ring else None,
                                  result_ring=self.result_ring.handle if rank == 0 else None)
                self.procs[rank] = self._spawn(args, write_fd)
            self.num_blocks = self._wait_ready(ready_fds, envs.SURGE_RANK_TIMEOUT)
        except BaseException:
            self.shutdown()
            raise
        finally:
            for fd in ready_fds.values():
                os.close(fd)
        for ring in (self.step_ring, self.result_ring):
            if ring is not None:
                ring.unlink()  # every rank has attached: the name is no longer needed
        logger.info("node %d: ranks %s ready (pids %s)", self.node_rank, list(self.procs),
                    [p.pid for p in self.procs.values()])

    @staticmethod
    def _spawn(args: WorkerArgs, write_fd: int) -> subprocess.Popen:
        # A fresh interpreter (not multiprocessing's spawn), so user scripts need no `if __name__ == "__main__"`.
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen([sys.executable, "-c", "from surge.worker.worker import run; run()"],
                                    stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env)
        finally:
            os.close(write_fd)
        proc.stdin.write(pickle.dumps(args))
        proc.stdin.close()
        return proc

    def _wait_ready(self, ready_fds: dict[int, int], timeout: float) -> int:
        decoder = msgspec.msgpack.Decoder(WorkerReady)
        pending = dict(ready_fds)
        num_blocks = 0
        self.load_seconds = 0.0  # the slowest rank's weight load
        deadline = time.monotonic() + timeout
        while pending:
            readable, _, _ = select.select(list(pending.values()), [], [], 0.1)
            for rank, fd in list(pending.items()):
                if fd not in readable:
                    continue
                data = os.read(fd, 1 << 16)
                if not data:  # closed without a word: the process died; check() below names it
                    continue
                ready = decoder.decode(data)
                if ready.error is not None:
                    self.fail(f"tensor-parallel rank {rank} failed to start: {ready.error}")
                num_blocks = min(num_blocks, ready.num_blocks) if num_blocks else ready.num_blocks
                self.load_seconds = max(self.load_seconds, ready.load_seconds)
                del pending[rank]
            self.check()
            if time.monotonic() > deadline:
                self.fail(f"ranks {sorted(pending)} did not start within {timeout:.0f} s (SURGE_RANK_TIMEOUT)")
        return num_blocks

    def check(self) -> None:
        """Raise WorkerDiedError, naming the rank, once any rank has exited."""
        if self._failure is not None:
            raise self._failure
        dead = {rank: p.returncode for rank, p in self.procs.items() if p.poll() is not None}
        if not dead:
            return
        time.sleep(0.1)  # a rank that lost its peer exits right after the peer: report them together
        dead = {rank: p.returncode for rank, p in self.procs.items() if p.poll() is not None}
        culprits = [r for r, code in dead.items() if code != PEER_LOST_EXIT] or list(dead)
        lines = [f"tensor-parallel rank {r} (pid {self.procs[r].pid}) {_describe_exit(dead[r])}" for r in culprits]
        others = sorted(set(dead) - set(culprits))
        if others:
            lines.append(f"ranks {others} then stopped because they lost it")
        self.fail("; ".join(lines) + "; the engine stops")

    def fail(self, message: str) -> None:
        logger.error("%s", message)
        self._failure = WorkerDiedError(message)
        self.shutdown(graceful=False)
        raise self._failure

    def wait(self) -> None:
        """Headless nodes: block until the ranks exit; raise if one failed."""
        while any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.2)
            if any(p.returncode not in (None, 0) for p in self.procs.values()):
                self.check()
        if any(p.returncode != 0 for p in self.procs.values()):
            self.check()

    def shutdown(self, graceful: bool = True, timeout: float = 5.0) -> None:
        """Stop every rank (a graceful stop was already requested through the ring, or is not needed)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + (timeout if graceful else 0.5)
        for p in self.procs.values():
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ring in (self.step_ring, self.result_ring):
            if ring is not None:
                ring.unlink()
                ring.close()


class _RemoteStep:
    """A step sent to the ranks; its result is the next one rank 0 writes that no earlier step took."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor = executor
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        ex = self._executor
        while self._output is None:
            ex._read_next_result()
        return self._output


class MultiprocExecutor:
    """Node 0's view of a tensor-parallel engine: steps go out through shared memory, results come from rank 0,
    one per step, in order. Launching a step never waits for the one before."""

    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        if pc.master_port is None:
            config = dataclasses.replace(config, parallel_config=dataclasses.replace(pc, master_port=_free_port()))
        self.config = config
        self.launcher = NodeLauncher(config)
        groups = kv_cache_groups(config)
        self.kv_cache_config = KVCacheConfig(groups, self.launcher.num_blocks, kv_live_block_caps(config, groups))
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        # Steps sent whose results were not read yet, oldest first (an abandoned handle's result is still read,
        # so the next one lines up).
        self._unread: deque[_RemoteStep] = deque()
        self._finalizer = weakref.finalize(self, _stop, self.launcher, self._encoder)
        self._model: torch.nn.Module | None = None

    def execute_async(self, out: SchedulerOutput) -> _RemoteStep:
        launcher = self.launcher
        launcher.check()
        launcher.step_ring.write(self._encoder.encode(out), check=launcher.check, timeout=envs.SURGE_RANK_TIMEOUT)
        step = _RemoteStep(self)
        self._unread.append(step)
        return step

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(out).result()

    def _read_next_result(self) -> None:
        timeout = envs.SURGE_RANK_TIMEOUT
        try:
            data = self.launcher.result_ring.read(check=self.launcher.check, timeout=timeout)
        except TimeoutError:
            self.launcher.fail(f"rank 0 did not answer a step within {timeout:.0f} s (SURGE_RANK_TIMEOUT); a rank "
                                "is hung, or one on another node died")
            raise
        self._unread.popleft()._output = self._decoder.decode(data)

    @property
    def load_seconds(self) -> float:
        """The slowest local rank's weight load."""
        return self.launcher.load_seconds

    @property
    def model(self) -> torch.nn.Module:
        """The whole model on the meta device: shapes and parameter counts for reports; the weights live in the
        workers."""
        if self._model is None:
            from surge.model.loader.base import build_model
            self._model = build_model(self.config.model_config, torch.device("meta"))
        return self._model

    def shutdown(self) -> None:
        self._finalizer()


def _stop(launcher: NodeLauncher, encoder: msgspec.msgpack.Encoder) -> None:
    """Ask the ranks to stop through the ring (they relay it to other nodes), then make sure they did."""
    if launcher._failure is None and not launcher._closed:
        try:
            launcher.step_ring.write(encoder.encode(SchedulerOutput(shutdown=True)), check=launcher.check,
                                     timeout=2.0)
        except Exception:  # full, or a rank is gone: the launcher terminates them instead
            pass
    launcher.shutdown()


def run_headless(config: EngineConfig) -> int:
    """A node other than 0: start this node's ranks and serve node 0's engine until it stops."""
    pc = config.parallel_config
    if pc.node_rank == 0:
        raise ValueError("run_headless is for nodes other than 0; node 0 runs the engine")
    launcher = NodeLauncher(config)
    logger.info("node %d of %d: ranks %s serve the engine on %s:%s until it stops", pc.node_rank, pc.nnodes,
                list(launcher.procs), pc.master_addr, pc.master_port)
    try:
        launcher.wait()
    finally:
        launcher.shutdown()
    return 0
