"""The processes of the disaggregation tests: `surge proxy` in its own process, instances started side by side (a
single plain one for reference beside the disaggregated ones), and an instance killed as a crash would."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import openai
from remote_server import RemoteServer, child_pids, free_port


class ProxyProcess:
    """`surge proxy *args` on a free port of 127.0.0.1, started once its /metrics answers."""

    def __init__(self, *args: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen([sys.executable, "-m", "surge.entrypoints.cli.main", "proxy", *args,
                                      "--port", self.url.rsplit(":", 1)[1]])
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, "surge proxy exited during start-up"
            assert time.monotonic() < deadline, "surge proxy did not start in 60 s"
            try:
                if httpx.get(self.url + "/metrics", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def start_side_by_side(*starts: Callable[[], RemoteServer]) -> list[RemoteServer]:
    """Each instance started in its own thread (start-up is mostly waiting); if any fails, the others are stopped
    and its error raised."""
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        starting = [pool.submit(start) for start in starts]
        concurrent.futures.wait(starting)
    failed = [f.exception() for f in starting if f.exception() is not None]
    if failed:
        for f in starting:
            if f.exception() is None:
                f.result().stop()
        raise failed[0]
    return [f.result() for f in starting]


def stop_cluster(proxy: ProxyProcess, servers: list[RemoteServer]) -> None:
    """The proxy, then each instance still running, in the order given."""
    proxy.stop()
    for server in servers:
        if server.proc.poll() is None:
            server.stop()


def kill(server: RemoteServer) -> None:
    """SIGKILL the server and its engine core: an instance that dies, not one that shuts down."""
    for pid in [server.proc.pid, *child_pids(server.proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.proc.wait(10)
