"""`surge bench proxy`: the disaggregation proxy's own cost. Stub upstreams that answer at once (a prefill answer
with kv_transfer_params, a decode answer as JSON or as an SSE stream) stand behind two proxies in the same run: the
byte-passthrough one (`surge proxy`) and a plain one that parses and re-encodes every body and every streamed event
(`ParsedBodies`, the baseline vLLM PR #56657 beat by 51%). Reports requests/s and latency through each, the latency
added over a direct call to the stub, and the ratio of the two proxies' requests/s; also requests per CPU-second of
each proxy process, which other load on the machine does not skew (wall-clock rates on a shared host do).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from surge.disagg.bodies import LIMIT_KEYS, Route

# ---- the baseline codec: everything parsed, everything re-encoded ----


class ParsedBodies:
    """A plain proxy's handling: json.loads of each body, a dict edited, json.dumps; each SSE event likewise."""

    def parse(self, body: bytes, api: str) -> Route:
        fields = json.loads(body)
        if not isinstance(fields, dict):
            raise TypeError("not a JSON object")
        prompt = fields.get("prompt")
        several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        return Route(bool(fields.get("stream", False)), fields.get("n", 1) == 1 and not several, fields)

    def prefill_body(self, route: Route, api: str, transfer_id: str) -> bytes:
        fields = {**route.body, **dict.fromkeys(LIMIT_KEYS[api], 1), "stream": False, "min_tokens": 0,
                  "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id}}
        fields.pop("stream_options", None)
        return json.dumps(fields).encode()

    def transfer_params(self, answer: bytes):
        return json.loads(answer).get("kv_transfer_params")

    def decode_body(self, route: Route, params) -> bytes:
        return json.dumps({**route.body, "kv_transfer_params": params}).encode()

    def relay(self, chunk: bytes) -> bytes:
        if not chunk.startswith((b"data:", b"event:")):
            return json.dumps(json.loads(chunk)).encode()
        out = []
        for event in chunk.split(b"\n\n"):
            lines = []
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    line = b"data: " + json.dumps(json.loads(line[6:])).encode()
                lines.append(line)
            out.append(b"\n".join(lines))
        return b"\n\n".join(out)


# ---- stub upstreams ----
@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 4096  # token ids in each request's prompt
    output_events: int = 256  # SSE events of a streamed answer (tokens)
    stream_share: float = 0.5  # of requests, the streamed ones
    num_blocks: int = 256  # block ids in the prefill's kv_transfer_params


def _stub_answers(w: Workload) -> dict[str, bytes]:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t" * 32,
              "remote_engine_id": "e" * 32, "remote_session": "127.0.0.1:15000", "remote_layout": [1 << 46, 600],
              "remote_layout_digest": "d" * 16, "remote_block_ids": [list(range(1, w.num_blocks + 1))],
              "remote_num_tokens": w.prompt_tokens, "expires_at": 1.8e9}
    choice = {"index": 0, "text": " word", "logprobs": None, "finish_reason": None, "stop_reason": None}
    head = {"id": "cmpl-" + "x" * 24, "object": "text_completion", "created": 1764547200, "model": "stub"}
    usage = {"prompt_tokens": w.prompt_tokens, "completion_tokens": w.output_events,
             "total_tokens": w.prompt_tokens + w.output_events, "prompt_tokens_details": {"cached_tokens": 0}}
    events = [b"data: " + json.dumps({**head, "choices": [choice]}).encode() + b"\n\n"] * w.output_events
    return {
        "prefill": json.dumps({**head, "choices": [{**choice, "finish_reason": "length"}], "usage": usage,
                               "kv_transfer_params": params}).encode(),
        "json": json.dumps({**head, "choices": [{**choice, "text": " word" * w.output_events,
                                                  "finish_reason": "length"}], "usage": usage}).encode(),
        "sse": b"".join(events) + b"data: [DONE]\n\n",
    }


def _stub_app(w: Workload):
    answers = _stub_answers(w)

    async def app(scope, receive, send):  # plain ASGI: the stub must cost next to nothing
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if b'"do_remote_decode":true' in body or b'"do_remote_decode": true' in body:
            kind, media = "prefill", b"application/json"
        elif b'"stream":true' in body or b'"stream": true' in body:
            kind, media = "sse", b"text/event-stream"
        else:
            kind, media = "json", b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", media)]})
        await send({"type": "http.response.body", "body": answers[kind]})
    return app


def _serve(kind: str, port: int, w: Workload, upstream: str) -> None:
    import uvicorn

    from surge.disagg.proxy import Proxy
    if kind == "stub":
        app = _stub_app(w)
    else:
        app = Proxy([upstream], [upstream], codec=ParsedBodies() if kind == "parsed" else None).app
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, timeout_s: float = 60.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.post(url + "/v1/completions", content=b"{}", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not start within {timeout_s} s")


# ---- the load ----
@dataclass
class Result:
    target: str
    requests: int
    seconds: float
    requests_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    latency_mean_ms: float
    cpu_seconds: float  # of the process measured (the proxy; the stub for "direct")
    requests_per_cpu_s: float  # what one core of it sustains: unlike requests/s, not skewed by other load


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _bodies(w: Workload, n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 32000) for _ in range(w.prompt_tokens)]
    out = []
    for i in range(n):
        stream = rng.random() < w.stream_share
        out.append(json.dumps({"model": "stub", "prompt": prompt, "max_tokens": w.output_events, "temperature": 0,
                               "stream": stream, "ignore_eos": True, "user": f"u{i}"}).encode())
    return out


async def _load(url: str, bodies: list[bytes], concurrency: int) -> tuple[float, list[float]]:
    import httpx
    latencies: list[float] = []
    queue = list(reversed(bodies))
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker() -> None:
            while queue:
                body = queue.pop()
                start = time.perf_counter()
                async with client.stream("POST", url + "/v1/completions", content=body,
                                         headers={"content-type": "application/json"}) as answer:
                    async for _ in answer.aiter_raw():
                        pass
                    if answer.status_code != 200:
                        raise RuntimeError(f"{url} answered {answer.status_code}")
                latencies.append(time.perf_counter() - start)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, latencies


def measure(target: str, url: str, pid: int, bodies: list[bytes], concurrency: int) -> Result:
    asyncio.run(_load(url, bodies[:max(8, len(bodies) // 10)], concurrency))  # warm connections and caches
    cpu = _cpu_seconds(pid)
    seconds, lat = asyncio.run(_load(url, bodies, concurrency))
    cpu = _cpu_seconds(pid) - cpu
    lat.sort()
    return Result(target, len(lat), seconds, len(lat) / seconds, 1e3 * statistics.median(lat),
                  1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1e3 * statistics.fmean(lat), cpu,
                  len(lat) / max(cpu, 1e-3))


def run_proxy_bench(num_requests: int = 400, concurrency: int = 16, workload: Workload = Workload(),
                    rounds: int = 2, seed: int = 0) -> dict:
    """Stub, passthrough proxy and parsing proxy, each in its own process; the load from this one, the two proxies
    measured alternately `rounds` times (the best round of each counts)."""
    ctx = multiprocessing.get_context("spawn")
    ports = {k: _free_port() for k in ("stub", "passthrough", "parsed")}
    stub = f"http://127.0.0.1:{ports['stub']}"
    procs = [ctx.Process(target=_serve, args=(k, p, workload, stub), daemon=True) for k, p in ports.items()]
    for p in procs:
        p.start()
    try:
        urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
        for url in urls.values():
            _wait_up(url)
        bodies = _bodies(workload, num_requests, seed)
        pids = {k: p.pid for k, p in zip(ports, procs)}
        direct = measure("direct", urls["stub"], pids["stub"], bodies, concurrency)
        best: dict[str, Result] = {}
        for _ in range(rounds):
            for k in ("passthrough", "parsed"):
                r = measure(k, urls[k], pids[k], bodies, concurrency)
                if k not in best or r.requests_per_s > best[k].requests_per_s:
                    best[k] = r
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(10)
    result = {"workload": asdict(workload), "concurrency": concurrency, "direct": asdict(direct),
              **{k: asdict(r) for k, r in best.items()},
              "added_latency_p50_ms": {k: r.latency_p50_ms - direct.latency_p50_ms for k, r in best.items()},
              "speedup": best["passthrough"].requests_per_s / best["parsed"].requests_per_s,
              "speedup_per_cpu_s": best["passthrough"].requests_per_cpu_s / best["parsed"].requests_per_cpu_s}
    return result


def add_proxy_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=Workload.prompt_tokens)
    p.add_argument("--output-events", type=int, default=Workload.output_events)
    p.add_argument("--stream-share", type=float, default=Workload.stream_share)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--result-json", default=None, help="also write the result here")


def cli(args: argparse.Namespace) -> int:
    for name in ("num_requests", "concurrency", "prompt_tokens", "output_events", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"surge bench proxy: --{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not 0 <= args.stream_share <= 1:
        raise SystemExit(f"surge bench proxy: --stream-share={args.stream_share} must be in [0, 1]")
    w = Workload(args.prompt_tokens, args.output_events, args.stream_share)
    result = run_proxy_bench(args.num_requests, args.concurrency, w, args.rounds)
    print(f"workload: {w.prompt_tokens} prompt token ids per request, {w.output_events} output events, "
          f"{w.stream_share:.0%} streamed; concurrency {args.concurrency}")
    print(f"{'target':<12} {'req/s':>9} {'req/cpu-s':>10} {'p50 ms':>9} {'p99 ms':>9} {'added p50 ms':>13}")
    for k in ("direct", "passthrough", "parsed"):
        r = result[k]
        added = result["added_latency_p50_ms"].get(k, 0.0)
        print(f"{k:<12} {r['requests_per_s']:>9.1f} {r['requests_per_cpu_s']:>10.1f} {r['latency_p50_ms']:>9.2f} "
              f"{r['latency_p99_ms']:>9.2f} {added:>13.2f}")
    print(f"byte passthrough / parse-and-re-encode: {result['speedup']:.2f}x requests/s, "
          f"{result['speedup_per_cpu_s']:.2f}x requests per proxy CPU-second")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2))
    return 0
