"""A Mooncake store on this host's loopback: its master, an HTTP metadata server and one store client that holds the
store's memory, so KV blocks outlive the engines that put them. Used by `surge kv-store serve` and the tests.

Every address is 127.0.0.1. The metadata server is Mooncake's Python one, not the master's embedded server: the
embedded one (0.3.13) binds every interface whatever --http_metadata_server_host says. The transfer engines'
data ports (the memory holder's, each engine's) are Mooncake's own choice and listen on every interface: no flag
changes that.
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from surge.logger import init_logger

logger = init_logger(__name__)

HOST = "127.0.0.1"
_DEFAULT_STOP_TIMEOUT_S = 5.0


def mooncake_package_dir() -> Path:
    """The installed `mooncake` package (mooncake-transfer-engine or its -non-cuda build), without importing it."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Mooncake store needs the `mooncake` package: pip install "
                           "mooncake-transfer-engine-non-cuda (CPU, or GPUs without CUDA 12) or "
                           "mooncake-transfer-engine (CUDA 12)")
    return Path(next(iter(spec.submodule_search_locations)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_open(port: int, timeout: float = 0.2) -> bool:
    try:
        socket.create_connection((HOST, port), timeout).close()
        return True
    except OSError:
        return False


@dataclass
class MooncakeStoreServer:
    """The processes of one store. Ports left at 0 are chosen free at start(); segment_size: bytes of KV the store
    holds (Mooncake evicts the oldest objects past 90% of it)."""
    rpc_port: int = 0
    metadata_port: int = 0
    segment_size: int = 1 << 30
    log_dir: Path | None = None
    metrics_port: int = 0
    holder_port: int = 0
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.metadata_port}/metadata"

    def connector_config(self, **extra) -> dict:
        """`kv_transfer_config` for engines that use this store."""
        return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"master": self.master_address,
                                              "metadata_server": self.metadata_server, **extra}}

    def start(self, timeout: float = 30.0) -> MooncakeStoreServer:
        if not (isinstance(self.segment_size, int) and self.segment_size >= 1 << 20):
            raise ValueError(f"segment_size={self.segment_size!r} must be at least 1 MiB (in bytes)")
        package = mooncake_package_dir()
        for name in ("rpc_port", "metadata_port", "metrics_port", "holder_port"):
            if not getattr(self, name):
                setattr(self, name, free_port())
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="surge-mooncake-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        atexit.register(self.stop)  # a process that exits without stopping the store takes it along
        try:
            self._spawn("metadata", [sys.executable, str(package / "http_metadata_server.py"), f"--host={HOST}",
                                     f"--port={self.metadata_port}", "--log-level=WARNING"])
            self._spawn("master", [str(package / "mooncake_master"), f"--rpc_port={self.rpc_port}",
                                   f"--rpc_address={HOST}", f"--metrics_host={HOST}",
                                   f"--metrics_port={self.metrics_port}"])
            self._wait_for("metadata", self.metadata_port, deadline)
            self._wait_for("master", self.rpc_port, deadline)
            # The holder mounts segment_size bytes into the store; engines' clients contribute none by default.
            self._spawn("holder", [str(package / "mooncake_client"), f"--host={HOST}", f"--port={self.holder_port}",
                                   f"--global_segment_size={self.segment_size}",
                                   f"--master_server_address={self.master_address}",
                                   f"--metadata_server={self.metadata_server}", "--protocol=tcp"])
            self._wait_for("holder", self.holder_port, deadline)
        except BaseException:
            self.stop()
            raise
        logger.info("Mooncake store on %s: master %s, metadata %s, %.2f GiB held (logs in %s)", HOST,
                    self.master_address, self.metadata_server, self.segment_size / 2**30, self.log_dir)
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def _wait_for(self, name: str, port: int, deadline: float) -> None:
        proc = self.procs[name]
        while not port_open(port):
            if proc.poll() is not None:
                raise RuntimeError(f"Mooncake {name} exited with code {proc.returncode} before listening on "
                                   f"{HOST}:{port}; its log: {self.log_dir / f'{name}.log'}\n{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Mooncake {name} did not listen on {HOST}:{port} in time; its log: "
                                   f"{self.log_dir / f'{name}.log'}")
            time.sleep(0.05)

    def log_tail(self, name: str, num_bytes: int = 2000) -> str:
        path = self.log_dir / f"{name}.log" if self.log_dir else None
        if path is None or not path.exists():
            return ""
        return path.read_bytes()[-num_bytes:].decode(errors="replace")

    def kill(self, name: str) -> None:
        """Kill one process at once (SIGKILL): tests of a store that goes away."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(_DEFAULT_STOP_TIMEOUT_S)

    def stop(self, timeout: float = _DEFAULT_STOP_TIMEOUT_S) -> None:
        """SIGTERM every process (the holder first: it unmounts from a live master), SIGKILL what is left."""
        atexit.unregister(self.stop)
        for name in ("holder", "master", "metadata"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        self.procs.clear()

    def dead(self) -> str | None:
        """The name of a process of the store that has exited, if any."""
        return next((name for name, p in self.procs.items() if p.poll() is not None), None)

    def __enter__(self) -> MooncakeStoreServer:
        return self.start() if not self.procs else self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(rpc_port: int, metadata_port: int, segment_gib: float, log_dir: str | None) -> int:
    """`surge kv-store serve`: start the store on loopback, print the engines' --kv-transfer-config, and keep it up
    until SIGINT/SIGTERM (exit 0) or until one of its processes dies (exit 1)."""
    if not (isinstance(segment_gib, (int, float)) and segment_gib > 0):
        raise ValueError(f"--segment-gib={segment_gib!r} must be a positive number of GiB")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # before anything starts: a signal at any point stops cleanly
        signal.signal(signum, lambda *_: stop.set())
    server = MooncakeStoreServer(rpc_port, metadata_port, int(segment_gib * 2**30), Path(log_dir) if log_dir else None)
    try:
        server.start()
        print(f"Mooncake store ready. Engines: --kv-transfer-config '{json.dumps(server.connector_config())}'",
              flush=True)
        while not stop.wait(0.2):
            if (dead := server.dead()) is not None:
                logger.error("Mooncake %s exited (code %s); stopping the store. Its log:\n%s", dead,
                             server.procs[dead].returncode, server.log_tail(dead))
                return 1
        return 0
    finally:
        server.stop()
