"""`surge weight-cache serve MODEL [engine options]`: one launcher per node starts a daemon per local device (per
rank on CPU), logs one READY line once they all serve, answers /health on an optional port (200 ready, 503
otherwise), and on SIGTERM stops them, which removes their sockets and frees their memory.

A CUDA IPC handle is valid only on the node that made it, so each node's launcher serves only its local devices.
Daemon ranks come from surge/distributed/ranks.py, the engine's own mapping, so engine rank r on node n finds the
daemon holding its shard. The daemons of all nodes form their own process group on --weight-cache-master-port
(required with nnodes > 1), open for their whole life, hence never the engine's master port.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec

from surge.config import EngineConfig, ParallelConfig
from surge.distributed.ranks import global_rank, local_world_size
from surge.logger import init_logger
from surge.weight_cache.daemon import DaemonArgs, DaemonReady
from surge.weight_cache.protocol import DaemonClient, Health, HealthReply, ProtocolError
from surge.weight_cache.socket_dir import ensure_private_dir, resolve_socket_dir

logger = init_logger(__name__)

_STOP_TIMEOUT = 10.0


def daemon_ranks(pc: ParallelConfig) -> list[tuple[int, int]]:
    """(local rank, global rank) of every daemon this node's launcher runs."""
    local = local_world_size(pc.tensor_parallel_size, pc.nnodes)
    return [(lr, global_rank(pc.node_rank, lr, local)) for lr in range(local)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_parallel_config(pc: ParallelConfig, weight_cache_master_port: int | None) -> ParallelConfig:
    """The engine's parallel layout, with the daemons' own rendezvous port."""
    if pc.nnodes > 1 and weight_cache_master_port is None:
        raise ValueError(f"--weight-cache-master-port is required when nnodes={pc.nnodes}: the daemons of every node "
                         "meet there (a port of its own, not the engine's --master-port)")
    if weight_cache_master_port is not None:
        if not 1 <= weight_cache_master_port <= 65535:
            raise ValueError(f"--weight-cache-master-port={weight_cache_master_port} must be in [1, 65535]")
        if weight_cache_master_port == pc.master_port:
            raise ValueError(f"--weight-cache-master-port={weight_cache_master_port} equals --master-port: the "
                             "daemons' process group stays open for their whole life, so it needs a port of its own")
    port = weight_cache_master_port
    if port is None and pc.tensor_parallel_size > 1:
        port = _free_port()
    return dataclasses.replace(pc, master_port=port)


def socket_states(socket_dir: str | Path) -> dict[str, str]:
    """Socket name -> the daemon's state ("ready", "released"), for every socket in the directory that answers."""
    states = {}
    for path in sorted(Path(socket_dir).glob("*.sock")):
        try:
            with DaemonClient(path, 2.0) as client:
                reply = client.request(Health())
        except (OSError, ProtocolError):
            continue
        if isinstance(reply, HealthReply):
            states[path.name] = reply.state
    return states


class HealthServer:
    """GET /health -> status() as JSON; on 127.0.0.1 unless told otherwise. Port 0 picks a free port."""

    def __init__(self, host: str, port: int, status: Callable[[], tuple[int, dict]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/health":
                    code, body = 404, {"error": "not found; GET /health"}
                else:
                    try:
                        code, body = status()
                    except Exception as e:
                        code, body = 503, {"status": "error", "error": f"{type(e).__name__}: {e}"}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="weight-cache-health")
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Launcher:
    def __init__(self, config: EngineConfig, socket_dir: str | None, weight_cache_master_port: int | None = None,
                 health_host: str = "127.0.0.1", health_port: int | None = None) -> None:
        if config.model_config.load_format != "safetensors":
            raise ValueError(f"load_format={config.model_config.load_format!r}: the weight cache serves a checkpoint "
                             "directory (load_format auto or safetensors)")
        pc = daemon_parallel_config(config.parallel_config, weight_cache_master_port)
        self.config = dataclasses.replace(config, parallel_config=pc)
        self.socket_dir = ensure_private_dir(resolve_socket_dir(socket_dir))
        self.ranks = daemon_ranks(pc)
        self.procs: dict[int, subprocess.Popen] = {}
        self.sockets: dict[int, str] = {}  # global rank -> socket path, once ready
        self.ready = False
        self._stop = threading.Event()
        self.health = HealthServer(health_host, health_port, self.status) if health_port is not None else None

    # ---- start-up ----
    def start(self, timeout: float) -> None:
        ready_fds: dict[int, int] = {}
        try:
            for local_rank, rank in self.ranks:
                read_fd, write_fd = os.pipe()
                ready_fds[rank] = read_fd
                args = DaemonArgs(config=self.config, rank=rank, local_rank=local_rank,
                                  socket_dir=str(self.socket_dir), parent_pid=os.getpid(), ready_fd=write_fd)
                self.procs[rank] = self._spawn(args, write_fd)
            readies = self._wait_ready(ready_fds, timeout)
        finally:
            for fd in ready_fds.values():
                os.close(fd)
        self.ready = True
        pc = self.config.parallel_config
        logger.info("READY node %d: %d daemon(s) serve ranks %s of %s from %s (%.2f GiB held, loaded in %.1f s)",
                    pc.node_rank, len(readies), sorted(readies), self.config.model_config.model, self.socket_dir,
                    sum(r.device_bytes for r in readies.values()) / 2**30,
                    max(r.load_seconds for r in readies.values()))

    @staticmethod
    def _spawn(args: DaemonArgs, write_fd: int) -> subprocess.Popen:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        # CUDA IPC of expandable segments needs pidfd_getfd (ptrace rights); plain segments export with cudaIpc.
        alloc_conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments:True" in alloc_conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf.replace("expandable_segments:True", "expandable_segments:False")
        try:
            proc = subprocess.Popen([sys.executable, "-c", "from surge.weight_cache.daemon import run; run()"],
                                    stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env)
        finally:
            os.close(write_fd)
        proc.stdin.write(pickle.dumps(args))  # parent to child over a pipe, never over the socket
        proc.stdin.close()
        return proc

    def _wait_ready(self, ready_fds: dict[int, int], timeout: float) -> dict[int, DaemonReady]:
        decoder = msgspec.msgpack.Decoder(DaemonReady)
        pending = dict(ready_fds)
        readies: dict[int, DaemonReady] = {}
        deadline = time.monotonic() + timeout
        while pending:
            if self._stop.is_set():
                raise RuntimeError("stopped before the daemons were ready")
            readable, _, _ = select.select(list(pending.values()), [], [], 0.1)
            for rank, fd in list(pending.items()):
                if fd not in readable:
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    continue  # the process died without a word: check_alive() names it
                ready = decoder.decode(data)
                if ready.error is not None:
                    raise RuntimeError(f"weight-cache daemon for rank {rank} failed to start: {ready.error}")
                readies[rank] = ready
                self.sockets[rank] = ready.socket
                del pending[rank]
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"weight-cache daemons for ranks {sorted(pending)} were not ready within "
                                   f"{timeout:.0f} s")
        return readies

    def check_alive(self) -> None:
        for rank, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"weight-cache daemon for rank {rank} (pid {p.pid}) exited with code {p.returncode}")

    # ---- serving ----
    def status(self) -> tuple[int, dict]:
        """/health: 200 once every local daemon answers "ready"; 503 while loading, after a release, or when one is
        unreachable."""
        node = self.config.parallel_config.node_rank
        if not self.ready:
            return 503, {"status": "loading", "node_rank": node, "ready_ranks": sorted(self.sockets)}
        states = {}
        for rank, path in sorted(self.sockets.items()):
            try:
                with DaemonClient(path, 2.0) as client:
                    reply = client.request(Health())
                states[str(rank)] = reply.state if isinstance(reply, HealthReply) else "error"
            except (OSError, ProtocolError) as e:
                states[str(rank)] = f"unreachable ({type(e).__name__})"
        ok = all(s == "ready" for s in states.values())
        overall = "ready" if ok else ("released" if "released" in states.values() else "unavailable")
        return (200 if ok else 503), {"status": overall, "node_rank": node, "ranks": states}

    def stop(self) -> None:
        self._stop.set()

    def wait(self) -> int:
        """Until stop() (SIGTERM) or a daemon exits: 0, or 1 when a daemon died on its own."""
        while not self._stop.wait(0.2):
            try:
                self.check_alive()
            except RuntimeError as e:
                logger.error("%s; stopping this node's other daemons", e)
                return 1
        return 0

    def shutdown(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + _STOP_TIMEOUT
        for rank, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("weight-cache daemon for rank %d did not stop within %.0f s; killing it", rank,
                               _STOP_TIMEOUT)
                p.kill()
                p.wait()
        if self.health is not None:
            self.health.close()


def serve(config: EngineConfig, socket_dir: str | None, weight_cache_master_port: int | None, health_host: str,
          health_port: int | None, start_timeout: float = 3600.0) -> int:
    """The launcher process: start, serve until SIGTERM / SIGINT, stop."""
    launcher = Launcher(config, socket_dir, weight_cache_master_port, health_host, health_port)
    previous = {sig: signal.signal(sig, lambda *_: launcher.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            launcher.start(start_timeout)
        except RuntimeError as e:
            if launcher._stop.is_set():
                return 0
            logger.error("%s", e)
            return 1
        return launcher.wait()
    finally:
        launcher.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
