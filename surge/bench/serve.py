"""`surge bench serve`: an online benchmark against any OpenAI-compatible server (Surge, vLLM, ...).

Random-token prompts (fixed or ranged lengths), with random images for a multimodal model (--image-size,
--images-per-prompt: base64 JPEG image_url parts of Chat), sent at a Poisson rate (or all at once) under a
concurrency cap, streamed; reports TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99), request, token and
image throughput and goodput under SLOs, and writes a JSON result and a PNG chart of the latency distributions.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from surge.bench.common import parse_image_size, random_image

_SLO_KEYS = ("ttft", "tpot", "e2e")
# Words for chat prompts, which must be text: about one token each in common vocabularies.
_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have "
          "an had they you were their one all we can her has there been if more when will would who so no").split()


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions sends token ids (exact input lengths); chat sends random words")
    g.add_argument("--model", default=None, help="model name (default: the server's first in /v1/models)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (a vLLM/Surge extension): outputs may then end early")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len x (1 - r), len x (1 + r)] (0: fixed)")
    g.add_argument("--vocab-size", type=int, default=32000,
                   help="prompt token ids are drawn from [100, vocab-size): at most the served model's vocabulary")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (inf: all at once)")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs a request must meet to count as good, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2e)")
    g.add_argument("--image-size", default=None, metavar="WxH",
                   help="an image workload (with --endpoint chat): random images of this size, e.g. 1024x1024, "
                   "sent as base64 JPEG image_url parts; each request's images are distinct")
    g.add_argument("--images-per-prompt", type=int, default=1, help="images per request with --image-size")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("output")
    g.add_argument("--result-json", default="bench-serve.json", help="where to write the result")
    g.add_argument("--chart", default="bench-serve.png", help="where to write the latency chart (PNG)")


@dataclass
class RequestResult:
    prompt_len: int
    expected_output_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def make_prompts(args: argparse.Namespace) -> list[tuple[list[int] | str | list[dict], int, int]]:
    """(prompt, input length, output length) per request; with images, the prompt is a message's content parts
    (its text, then the images)."""
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError(f"--range-ratio={args.range_ratio} must be in [0, 1)")
    if args.vocab_size <= 100:
        raise ValueError(f"--vocab-size={args.vocab_size} must be > 100 (ids below 100 are skipped: often special)")
    image_size = None
    if args.image_size is not None:
        image_size = parse_image_size(args.image_size)
        if args.endpoint != "chat":
            raise ValueError("--image-size needs --endpoint chat (images are chat content parts)")
        if args.images_per_prompt < 1:
            raise ValueError(f"--images-per-prompt={args.images_per_prompt} must be >= 1")
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        return rng.randint(max(1, int(mean * (1 - args.range_ratio))), max(1, int(mean * (1 + args.range_ratio))))

    out = []
    for _ in range(args.num_prompts):
        n_in, n_out = length(args.input_len), length(args.output_len)
        if args.endpoint == "completions":
            prompt = [rng.randrange(100, args.vocab_size) for _ in range(n_in)]
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        if image_size is not None:
            images = [_image_part(image_size, rng.randrange(1 << 62)) for _ in range(args.images_per_prompt)]
            prompt = [{"type": "text", "text": prompt}, *images]
        out.append((prompt, n_in, n_out))
    return out


def _image_part(size: tuple[int, int], seed: int) -> dict:
    buf = io.BytesIO()
    random_image(size, seed).save(buf, format="JPEG", quality=90)
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        key, _, ms = item.partition(":")
        if key not in _SLO_KEYS:
            raise ValueError(f"--goodput {item!r}: unknown key {key!r}; known: {', '.join(_SLO_KEYS)}")
        try:
            slos[key] = float(ms) / 1000.0
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {ms!r} is not a number of milliseconds") from None
    return slos


async def _send(client, url: str, headers: dict, payload: dict, prompt_len: int) -> RequestResult:
    result = RequestResult(prompt_len, payload["max_tokens"])
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                text = choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                chunks += 1
    except Exception as e:  # a benchmark reports failures, it does not stop at the first
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_len = result.output_len or chunks
    return result


async def _run(args: argparse.Namespace, prompts, model: str) -> tuple[list[RequestResult], float]:
    import httpx

    base = args.base_url.rstrip("/")
    url = f"{base}/v1/completions" if args.endpoint == "completions" else f"{base}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed + 1)
    limit = args.max_concurrency or len(prompts)
    semaphore = asyncio.Semaphore(limit)

    def payload(prompt, n_out: int, stream: bool = True) -> dict:
        body = {"model": model, "max_tokens": n_out, "temperature": 0.0, "stream": stream,
                "stream_options": {"include_usage": True}}
        if not args.no_ignore_eos:
            body.update(ignore_eos=True, min_tokens=n_out)
        if args.endpoint == "completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        return body

    async def limited(client, prompt, n_in: int, n_out: int) -> RequestResult:
        async with semaphore:
            return await _send(client, url, headers, payload(prompt, n_out), n_in)

    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        # One short request first: a server that refuses the workload fails the benchmark at once, clearly.
        probe = await _send(client, url, headers, payload(prompts[0][0], 2), prompts[0][1])
        if probe.error is not None:
            raise RuntimeError(f"the test request failed: {probe.error}")
        tasks = []
        start = time.perf_counter()
        for i, (prompt, n_in, n_out) in enumerate(prompts):
            tasks.append(asyncio.ensure_future(limited(client, prompt, n_in, n_out)))
            if math.isfinite(args.request_rate) and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _fetch_model(args: argparse.Namespace) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    response = httpx.get(f"{args.base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _summary(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 in milliseconds (0 for an empty list)."""
    if not values:
        return {"mean_ms": 0.0, "p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)

    def pct(q: float) -> float:  # linear interpolation, as numpy's default
        pos = (len(ordered) - 1) * q
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"mean_ms": statistics.fmean(values) * 1000, "p50_ms": pct(0.5) * 1000, "p90_ms": pct(0.9) * 1000,
            "p99_ms": pct(0.99) * 1000}


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float], images_per_request: int = 0
              ) -> dict:
    ok = [r for r in results if r.error is None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    good = [r for r in ok if r.ttft <= slos.get("ttft", math.inf) and r.e2e <= slos.get("e2e", math.inf)
            and (r.tpot or 0.0) <= slos.get("tpot", math.inf)]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        # Requests whose output length differs from the one asked for (EOS without ignore_eos, or a server
        # that ignores it): their tokens still count, but the workload was not the one configured.
        "output_len_mismatches": sum(r.output_len != r.expected_output_len for r in ok),
        "errors": sorted({r.error for r in results if r.error is not None})[:5],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "image_throughput": len(ok) * images_per_request / duration,  # images/s (prompt tokens include theirs)
        "goodput": {"slos_ms": {k: v * 1000 for k, v in slos.items()}, "good_requests": len(good),
                    "request_goodput": len(good) / duration} if slos else None,
        "ttft": _summary([r.ttft for r in ok]),
        "tpot": _summary(tpots),
        "itl": _summary([t for r in ok for t in r.itls]),
        "e2e": _summary([r.e2e for r in ok]),
    }


def write_chart(results: list[RequestResult], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.error is None]
    series = {"TTFT": [r.ttft for r in ok], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL": [t for r in ok for t in r.itls], "E2E latency": [r.e2e for r in ok]}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, values) in zip(axes.flat, series.items()):
        ms = [v * 1000 for v in values]
        ax.set_title(name)
        ax.set_xlabel("ms")
        if not ms:
            continue
        ax.hist(ms, bins=min(40, max(5, len(ms) // 2)), color="#4c72b0")
        s = _summary(values)
        for key, style in (("p50_ms", "--"), ("p99_ms", ":")):
            ax.axvline(s[key], color="#c44e52", linestyle=style, label=f"{key[:3]} {s[key]:.1f} ms")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_serve_bench(args: argparse.Namespace) -> dict:
    slos = parse_goodput(args.goodput)
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate={args.request_rate} must be > 0 (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} must be >= 1")
    prompts = make_prompts(args)
    model = args.model or _fetch_model(args)
    results, duration = asyncio.run(_run(args, prompts, model))
    images = args.images_per_prompt if args.image_size is not None else 0
    summary = summarize(results, duration, slos, images)
    config = {k: getattr(args, k) for k in ("base_url", "endpoint", "num_prompts", "input_len", "output_len",
                                            "range_ratio", "request_rate", "max_concurrency", "seed",
                                            "image_size")}
    config["images_per_prompt"] = images
    config["request_rate"] = str(config["request_rate"])  # inf is no JSON number
    report = {"model": model, "config": config, **summary,
              "requests": [asdict(r) | {"tpot": r.tpot} for r in results]}
    Path(args.result_json).write_text(json.dumps(report, indent=1))
    title = (f"{model}: {args.num_prompts} requests, in {args.input_len} / out {args.output_len}"
             + (f" + {images} x {args.image_size} image(s)" if images else "")
             + f", rate {args.request_rate}, concurrency {args.max_concurrency or 'unbounded'}")
    write_chart(results, Path(args.chart), title)
    _print(model, summary, args)
    return report


def _print(model: str, s: dict, args: argparse.Namespace) -> None:
    print(f"==== surge bench serve: {model} at {args.base_url} ====")
    print(f"requests: {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.2f} s"
          + (f" ({s['output_len_mismatches']} with another output length than asked)"
             if s["output_len_mismatches"] else ""))
    for e in s["errors"]:
        print(f"  error: {e}")
    print(f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
          f"{s['total_token_throughput']:.1f} total tok/s"
          + (f", {s['image_throughput']:.2f} images/s ({args.images_per_prompt} x {args.image_size} per request)"
             if s["image_throughput"] else ""))
    if s["goodput"]:
        print(f"goodput: {s['goodput']['request_goodput']:.2f} req/s ({s['goodput']['good_requests']} requests met "
              f"{s['goodput']['slos_ms']} ms)")
    print(f"{'ms':>6} {'mean':>10} {'p50':>10} {'p90':>10} {'p99':>10}")
    for key in ("ttft", "tpot", "itl", "e2e"):
        m = s[key]
        print(f"{key.upper():>6} {m['mean_ms']:10.1f} {m['p50_ms']:10.1f} {m['p90_ms']:10.1f} {m['p99_ms']:10.1f}")
    print(f"wrote {args.result_json} and {args.chart}")
