"""A live `surge serve` in a subprocess on 127.0.0.1 and a free port: bounded start-up wait, torn down on exit."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from processes import pid_alive

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_chat_template(model_dir: Path, template: str = CHATML) -> Path:
    """Tiny models' byte tokenizer has no chat template; give it a ChatML one."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(model_dir)
    return model_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of a process, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children



class RemoteServer:
    def __init__(self, model: str | Path | None, *args: str, api_key: str | None = None,
                 startup_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "surge.entrypoints.cli.main", "serve"]
        cmd += [str(model)] if model is not None else []
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "SURGE_LOG_LEVEL": "WARNING"})
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"surge serve exited during start-up with code {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"surge serve was not healthy within {timeout} s")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name (labels dropped; one model per server)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                key = name.split("{", 1)[0]
                if "finished_reason" in name:
                    key += "{" + name.split("finished_reason=\"", 1)[1].split("\"", 1)[0] + "}"
                samples[key] = samples.get(key, 0.0) + float(value)
        return samples

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds KV blocks (aborts land asynchronously), or at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["surge:num_requests_running"], m["surge:num_requests_waiting"], m["surge:kv_cache_usage_perc"])
            if idle == (0.0, 0.0, 0.0) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def client(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=60, **kwargs)

    def async_client(self, **kwargs):
        import openai
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=60, **kwargs)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, as a process manager would; fails when the server leaves a process behind (the core)."""
        if self.proc.poll() is not None:
            return
        children = child_pids(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)
        deadline = time.monotonic() + timeout
        while any(map(pid_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphans = [pid for pid in children if pid_alive(pid)]
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        assert not orphans, f"surge serve left processes {orphans} behind"

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
