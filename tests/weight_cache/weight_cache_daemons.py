"""Daemons for the weight-cache tests: in this process (a thread serves the socket), or `surge weight-cache serve`
in a subprocess (a bounded wait until its sockets answer "ready" and it has logged READY, its log in a file, SIGTERM
then SIGKILL on the way out); and a /health client."""
from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from surge import LLM, SamplingParams
from surge.engine.args import EngineArgs
from surge.weight_cache.daemon import WeightCacheDaemon
from surge.weight_cache.launcher import socket_states
from surge.weight_cache.protocol import DaemonClient, Health
from processes import pid_alive

ENGINE = dict(device="cpu", max_model_len=128, block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=24)
ENGINE_ARGS = ("--device", "cpu", "--max-model-len", "128")
# One workload for every comparison with a disk load: greedy with logprobs, seeded sampling, a penalty.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [100, 3, 250, 17], list(range(30, 70))]
PARAMS = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3)]


def generate(model_dir, tp: int = 1, **kwargs) -> list[list[int]]:
    """Output tokens of an engine with these options (the disk-load reference when there are none)."""
    if tp == 1 and not kwargs:
        return _from_disk(str(model_dir))
    llm = LLM(model_dir, tensor_parallel_size=tp, **{**ENGINE, **kwargs})
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


@functools.cache
def _from_disk(model_dir: str) -> list[list[int]]:
    """The reference: one rank loading from disk (computed once per checkpoint)."""
    llm = LLM(model_dir, **ENGINE)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


def cached(socket_dir, **kwargs) -> dict:
    return dict(load_format="weight_cache", weight_cache_dir=str(socket_dir), **kwargs)


@contextlib.contextmanager
def running_daemon(model_dir: Path, socket_dir: Path, **engine):
    """A started daemon in this process whose socket a thread serves; closed (socket and lock removed) on exit."""
    config = EngineArgs(model_dir, **{"device": "cpu", "max_model_len": 128, **engine}).create_engine_config()
    daemon = WeightCacheDaemon(config, 0, torch.device("cpu"), socket_dir)
    daemon.start()
    thread = threading.Thread(target=daemon.serve_forever, daemon=True)
    thread.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        thread.join(5)
        daemon.close()


def get_health(port: int, path: str = "/health") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # no proxy, whatever the environment says
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


class ServeProcess:
    def __init__(self, model_dir: Path, socket_dir: Path, *args: str, num_sockets: int = 1, wait: bool = True,
                 timeout: float = 90.0) -> None:
        self.socket_dir = Path(socket_dir)
        self.num_sockets = num_sockets
        self.log_path = self.socket_dir.parent / f"serve-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "surge.entrypoints.cli.main", "weight-cache", "serve", str(model_dir),
               *ENGINE_ARGS, "--weight-cache-dir", str(socket_dir), *args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "SURGE_LOG_LEVEL": "INFO"})
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop()
                raise

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"surge weight-cache serve exited with {self.proc.returncode}:\n{self.log()}")
            states = socket_states(self.socket_dir) if self.socket_dir.is_dir() else {}
            if len(states) >= self.num_sockets and set(states.values()) == {"ready"} and "READY node" in self.log():
                return
            time.sleep(0.05)
        raise TimeoutError(f"the daemons were not ready within {timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def daemon_pid(self, socket_name: str = "rank-0.sock") -> int:
        with DaemonClient(self.socket_dir / socket_name, 5.0) as client:
            return client.request(Health()).pid

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()



def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False
