"""One weight-cache daemon: owns one device's socket, loads this rank's shard exactly as an engine would (through
the engine's own `load_model`), then serves it to engines until SIGTERM. launcher.py starts one per local device
(per rank on CPU) and runs `run()`; tests also drive WeightCacheDaemon in-process.

Order matters: the lock, then the key (computed before loading, which may change the config), then the weights,
and only then the socket, so an engine that arrives early finds no socket and falls back at once. A malformed,
oversized or unknown frame gets an error reply; nothing a client sends ends the daemon.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from surge.config import EngineConfig
from surge.logger import init_logger
from surge.model.loader.base import load_model
from surge.weight_cache.key import socket_name, weight_cache_key
from surge.weight_cache.protocol import (MAX_REQUEST_BYTES, ConnectionClosed, ErrorReply, GetMemory, GetState,
                                         HealthReply, MemoryReply, ProtocolError, Release, ReleaseReply, StateReply,
                                         WeightCacheKey, decode_request, describe_key_mismatch, key_differences,
                                         recv_frame, send_fds, send_frame)
from surge.weight_cache.socket_dir import (DaemonLock, LockHeldError, UnsafePathError, bind_socket, ensure_private_dir,
                                           lock_path, peer_credentials, resolve_socket_dir)
from surge.weight_cache.tensor_table import TensorTable, export_handles, export_tensors, share_cpu_storages

logger = init_logger(__name__)

MAX_CONNECTIONS = 32
IDLE_TIMEOUT = 30.0  # a connection that sends nothing for this long is closed


class WeightCacheDaemon:
    def __init__(self, config: EngineConfig, rank: int, device: torch.device, socket_dir: str | Path | None) -> None:
        if config.model_config.load_format != "safetensors":
            raise ValueError(f"the weight cache serves checkpoints; load_format={config.model_config.load_format!r} "
                             "is not one (give an HF-format checkpoint directory)")
        self.config, self.rank, self.device = config, rank, device
        self.socket_dir = ensure_private_dir(resolve_socket_dir(socket_dir))
        self.socket_path = self.socket_dir / socket_name(device, rank)
        self.lock = DaemonLock(lock_path(self.socket_path))
        self.state = "loading"  # -> "ready" once bound -> "released" after a copy-mode engine's release
        self.key: WeightCacheKey | None = None
        self.model: torch.nn.Module | None = None
        self.table: TensorTable | None = None
        self.load_seconds = 0.0
        self.device_bytes = 0
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._state_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    # ---- start-up ----
    def acquire(self) -> None:
        self.lock.acquire()

    def compute_key(self) -> WeightCacheKey:
        self.key = weight_cache_key(self.config.model_config, self.config.parallel_config, self.rank, self.device)
        return self.key

    def load(self) -> None:
        start = time.perf_counter()
        model = load_model(self.config, self.device)
        table = export_tensors(model)
        share_cpu_storages(table)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what loading staged goes back to the driver: engines size their KV cache by it
        self.model, self.table, self.device_bytes = model, table, table.nbytes
        self.load_seconds = time.perf_counter() - start
        logger.info("rank %d: loaded %d tensors (%.2f GiB on %s) in %.2f s", self.rank, len(table.tensors),
                    self.device_bytes / 2**30, self.device, self.load_seconds)

    def bind(self) -> None:
        listener = bind_socket(self.socket_path)
        listener.settimeout(0.2)  # accept() wakes up to notice a stop request
        self._listener = listener
        self.state = "ready"

    def start(self) -> None:
        """Everything before serving, in order (for in-process use)."""
        self.acquire()
        self.compute_key()
        self.load()
        self.bind()

    # ---- serving ----
    def serve_forever(self) -> None:
        assert self._listener is not None, "bind() first"
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                raise
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, ErrorReply(code="busy", message=f"{MAX_CONNECTIONS} connections are open"))
                continue
            threading.Thread(target=self._serve_connection, args=(conn,), daemon=True,
                             name=f"weight-cache-conn-{self.rank}").start()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Stop serving, remove our socket, free the weights, give up the lock."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        with self._state_lock:
            self.model = self.table = None
            self.device_bytes = 0
        self.lock.release()

    @staticmethod
    def _refuse(conn: socket.socket, reply: ErrorReply) -> None:
        try:
            conn.settimeout(1.0)
            send_frame(conn, reply)
        except OSError:
            pass
        conn.close()

    def _serve_connection(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(IDLE_TIMEOUT)
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # the CUDA device is per thread
                pid, uid, _ = peer_credentials(conn)
                if uid != os.getuid():
                    logger.warning("rank %d: refused a connection from pid %d of uid %d", self.rank, pid, uid)
                    send_frame(conn, ErrorReply(code="forbidden", message="this daemon serves its own user only"))
                    return
                while not self._stop.is_set():
                    try:
                        data = recv_frame(conn, MAX_REQUEST_BYTES)
                    except ConnectionClosed:
                        return
                    except ProtocolError as e:  # too large: the stream is out of step, so answer and hang up
                        logger.warning("rank %d: pid %d: %s", self.rank, pid, e)
                        send_frame(conn, ErrorReply(code=e.code, message=str(e)))
                        return
                    reply, fds = self.handle(data, pid)
                    try:
                        send_frame(conn, reply)
                        if fds:
                            send_fds(conn, fds)
                    finally:
                        for fd in fds:
                            os.close(fd)
        except OSError:  # the peer went away or stalled past IDLE_TIMEOUT
            pass
        except Exception:
            logger.exception("rank %d: a connection failed", self.rank)
        finally:
            self._slots.release()

    def handle(self, data: bytes, peer_pid: int = 0) -> tuple[msgspec.Struct, list[int]]:
        """One request frame's body -> (reply, descriptors the caller sends after it and then closes)."""
        try:
            request = decode_request(data)
        except ProtocolError as e:
            logger.warning("rank %d: rejected a frame from pid %d: %s", self.rank, peer_pid, e)
            return ErrorReply(code=e.code, message=str(e)), []
        try:
            if isinstance(request, GetState):
                return self._get_state(request, peer_pid)
            if isinstance(request, Release):
                return self._release(request, peer_pid), []
            if isinstance(request, GetMemory):
                return self._memory(), []
            return HealthReply(state=self.state, pid=os.getpid(), key=self.key, load_seconds=self.load_seconds,
                               device_bytes=self.device_bytes), []
        except Exception as e:
            logger.exception("rank %d: a %s request failed", self.rank, type(request).__name__)
            return ErrorReply(code="internal", message=f"{type(e).__name__}: {e}"), []

    def _unavailable(self) -> ErrorReply:
        return ErrorReply(code=self.state, message=f"the weights are {self.state}")

    def _get_state(self, request: GetState, peer_pid: int) -> tuple[msgspec.Struct, list[int]]:
        with self._state_lock:
            if self.state != "ready":
                return self._unavailable(), []
            diff = key_differences(self.key, request.key)
            if diff:
                message = describe_key_mismatch(self.key, request.key)
                logger.warning("rank %d: pid %d: %s", self.rank, peer_pid, message)
                return ErrorReply(code="key_mismatch", message=message, fields=diff), []
            handles, fds = export_handles(self.table)
            # Our own duplicates: a release right after this may close the storages' descriptors before they are sent.
            fds = [os.dup(fd) for fd in fds]
            reply = StateReply(device_kind=self.device.type, storages=handles, tensors=self.table.tensors,
                               aliases=self.table.aliases, num_fds=len(fds))
        logger.info("rank %d: served %d tensors to pid %d (%s)", self.rank, len(reply.tensors), peer_pid, request.mode)
        return reply, fds

    def _release(self, request: Release, peer_pid: int) -> msgspec.Struct:
        with self._state_lock:
            if self.state != "ready":
                return self._unavailable()
            diff = key_differences(self.key, request.key)
            if diff:
                return ErrorReply(code="key_mismatch", message=describe_key_mismatch(self.key, request.key),
                                  fields=diff)
            freed = self.device_bytes
            self.model = self.table = None
            self.device_bytes = 0
            self.state = "released"
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver, so the engine's budget sees it free
        logger.info("rank %d: released %.1f MiB for pid %d (copy mode); a restart reloads from disk", self.rank,
                    freed / 2**20, peer_pid)
        return ReleaseReply(freed_bytes=freed)

    def _memory(self) -> MemoryReply:
        table = self.table
        return MemoryReply(state=self.state, device=str(self.device), device_bytes=self.device_bytes,
                           num_tensors=len(table.tensors) if table else 0,
                           num_storages=len(table.storages) if table else 0)


# ---- the daemon process (started by launcher.py) ----

@dataclass
class DaemonArgs:
    config: EngineConfig  # its parallel config's master_port is the weight cache's own rendezvous port
    rank: int  # global rank, from surge/distributed/ranks.py
    local_rank: int
    socket_dir: str
    parent_pid: int
    ready_fd: int  # the daemon writes one DaemonReady here


class DaemonReady(msgspec.Struct, array_like=True):
    socket: str = ""
    load_seconds: float = 0.0
    device_bytes: int = 0
    error: str | None = None


class Terminated(BaseException):
    """SIGTERM while loading: stop at once."""


def agree_on_model(key: WeightCacheKey) -> None:
    """Every daemon rank, on every node, must serve the same model configuration: compare digests over the daemons'
    own process group. The checkpoint field is left out: each node has its own copy (another mtime)."""
    import torch.distributed as dist

    from surge.distributed.parallel_state import get_tp_group
    tp = get_tp_group()
    shared = msgspec.structs.replace(key, checkpoint="", tensor_parallel_rank=0, device_uuid="", device_arch="")
    mine = torch.frombuffer(bytearray(hashlib.sha256(msgspec.msgpack.encode(shared)).digest()), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(tp.world_size)]
    dist.all_gather(gathered, mine, group=tp.cpu_group)
    differ = [r for r, t in enumerate(gathered) if not torch.equal(t, mine)]
    if differ:
        raise RuntimeError(f"daemon ranks {differ} were started with another model configuration than rank {tp.rank} "
                           "(model config, dtype, max_model_len or versions differ): give every node's launcher the "
                           "same engine options")


def main() -> int:
    from surge.distributed.lifecycle import die_with_parent
    from surge.distributed.parallel_state import destroy_distributed, init_distributed

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the launcher decides
    args: DaemonArgs = pickle.load(sys.stdin.buffer)  # from the launcher that spawned us, never from a socket
    die_with_parent(args.parent_pid, signal.SIGTERM)  # SIGTERM, not SIGKILL: the socket and lock are cleaned up
    config = args.config
    if config.device.type == "cuda":
        device = torch.device("cuda", args.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel_config.local_world_size))
    config = dataclasses.replace(config, device=device)
    encoder = msgspec.msgpack.Encoder()
    daemon: WeightCacheDaemon | None = None

    def on_sigterm(signum, frame) -> None:
        if daemon is None or daemon.state == "loading":
            raise Terminated()
        daemon.stop()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        daemon = WeightCacheDaemon(config, args.rank, device, args.socket_dir)
        daemon.acquire()
        key = daemon.compute_key()
        if not config.parallel_config.in_process:
            init_distributed(config.parallel_config, args.rank, device)  # open for the daemon's whole life
            agree_on_model(key)
        daemon.load()
        daemon.bind()
    except Terminated:
        if daemon is not None:
            daemon.close()
        return 0
    except BaseException as e:
        if not isinstance(e, (LockHeldError, UnsafePathError)):  # those two say all there is to say
            traceback.print_exc()
        os.write(args.ready_fd, encoder.encode(DaemonReady(error=f"rank {args.rank}: {type(e).__name__}: {e}")))
        if daemon is not None:
            daemon.close()
        return 1
    os.write(args.ready_fd, encoder.encode(DaemonReady(socket=str(daemon.socket_path), load_seconds=daemon.load_seconds,
                                                       device_bytes=daemon.device_bytes)))
    os.close(args.ready_fd)
    try:
        daemon.serve_forever()
    finally:
        daemon.close()
        destroy_distributed()
    logger.info("rank %d: stopped; %s removed", args.rank, daemon.socket_path)
    return 0


def run() -> None:
    """The process entry point: exits without the interpreter's slow teardown once the daemon is done."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
