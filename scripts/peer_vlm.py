"""vLLM 0.24 on `surge bench serve --endpoint chat --image-size WxH`'s image workload, dummy weights: images/s, TTFT
and TPOT at each concurrency, for the figures beside Surge's (scripts/h200 stage vlm-bench).

vLLM runs in-process (AsyncLLM, no HTTP): each request goes the way vLLM's OpenAI server takes a chat request, its
renderer (the model's chat template, the base64 JPEG decoded, the HF processor in its thread pool), then
`AsyncLLM.generate` with output deltas, under the server's defaults (its usage context). So vLLM's TTFT lacks the
HTTP and SSE costs that Surge's (measured by the HTTP client) includes: a few milliseconds in vLLM's favour. Its
prompt is one token shorter than Surge's: Qwen's template puts the image right after the text, Surge's renderer a
newline between parts. `--path prompt` instead hands AsyncLLM the rendered text and the decoded image
(`multi_modal_data`), processed on the event loop, as offline `LLM.generate` would. vLLM's Qwen2.5-VL path loads
transformers' Qwen2_5_VLProcessor, which needs torchvision (checked first: without it the script says so and exits 3).

The workload is `surge bench serve`'s (same algorithm and seed: tests/bench/test_peer_vlm.py checks prompts and image
pixels equal): per request `--input-len` random common words, then `--images-per-prompt` random images (JPEG, quality
90), greedy, EOS ignored, `--output-len` tokens; one short request first as a warm-up.

Usage, on the GPU machine with vLLM installed as ../shared/tools/vllm-peer/README.md says, DIR from
`surge preset-dir qwen2.5-vl-7b DIR` (config.json, preprocessor_config.json, the synthetic tokenizer):
  PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \\
    python3 scripts/peer_vlm.py DIR [--concurrency 1,32 --num-prompts 16,128]
Keep Surge's PYTHONPATH out of it: the two pin different msgspec/pyzmq. This file imports nothing of Surge.
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
import sys
import time

# surge.bench.serve's word list (checked equal by the test).
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have "
         "an had they you were their one all we can her has there been if more when will would who so no").split()


def random_jpeg(size: tuple[int, int], seed: int) -> bytes:
    """surge.bench.common.random_image(size, seed) as the JPEG `surge bench serve` sends."""
    import numpy as np
    from PIL import Image
    width, height = size
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_requests(num_prompts: int, input_len: int, output_len: int, image_size: tuple[int, int],
                  images_per_prompt: int = 1, range_ratio: float = 0.0, seed: int = 0) -> list[tuple[str, list, int]]:
    """(text, JPEG bytes per image, output length) per request: surge.bench.serve.make_prompts's draws, in its
    order."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return rng.randint(max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio))))

    out = []
    for _ in range(num_prompts):
        n_in, n_out = length(input_len), length(output_len)
        text = " ".join(rng.choice(WORDS) for _ in range(n_in))
        images = [random_jpeg(image_size, rng.randrange(1 << 62)) for _ in range(images_per_prompt)]
        out.append((text, images, n_out))
    return out


def summary_ms(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 in ms, percentiles interpolated linearly (as surge bench serve's)."""
    if not values:
        return {"mean_ms": 0.0, "p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)

    def pct(q: float) -> float:
        pos = (len(ordered) - 1) * q
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"mean_ms": statistics.fmean(values) * 1000, "p50_ms": pct(0.5) * 1000, "p90_ms": pct(0.9) * 1000,
            "p99_ms": pct(0.99) * 1000}


def chat_messages(text: str, images: list[bytes]) -> list[dict]:
    """The request body's messages, as `surge bench serve` sends them: the text part, then each image as a
    base64 data URL."""
    parts = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(j).decode()}}
             for j in images]
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


async def one_request(engine, path: str, text: str, images: list[bytes], n_out: int, request_id: str) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    params = SamplingParams(temperature=0.0, max_tokens=n_out, min_tokens=n_out, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    start = time.perf_counter()
    if path == "chat":
        from vllm.renderers import ChatParams
        chat = ChatParams(chat_template_kwargs={"add_generation_prompt": True})  # as a request's default
        _, (prompt,) = await engine.renderer.render_chat_async([chat_messages(text, images)], chat)
    else:
        from PIL import Image
        tokenizer = engine.renderer.get_tokenizer()
        content = [{"type": "text", "text": text}, *({"type": "image"} for _ in images)]
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
        decoded = [Image.open(io.BytesIO(j)).convert("RGB") for j in images]
        prompt = {"prompt": rendered, "multi_modal_data": {"image": decoded if len(decoded) > 1 else decoded[0]}}
    ttft, tokens, prompt_len = None, 0, 0
    async for out in engine.generate(prompt, params, request_id):
        if out.outputs and out.outputs[0].token_ids:
            tokens += len(out.outputs[0].token_ids)
            ttft = ttft if ttft is not None else time.perf_counter() - start
        prompt_len = len(out.prompt_token_ids or []) or prompt_len
    e2e = time.perf_counter() - start
    return {"ttft": ttft, "e2e": e2e, "output_len": tokens, "prompt_len": prompt_len,
            "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else None}


async def run_level(engine, args, concurrency: int, num_prompts: int) -> dict:
    requests = make_requests(num_prompts, args.input_len, args.output_len, args.image_size, args.images_per_prompt,
                             seed=args.seed)
    semaphore = asyncio.Semaphore(concurrency)

    async def limited(i: int, text: str, images: list, n_out: int) -> dict:
        async with semaphore:
            return await one_request(engine, args.path, text, images, n_out, f"c{concurrency}-{i}")

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(i, *r) for i, r in enumerate(requests)))
    duration = time.perf_counter() - start
    output_tokens = sum(r["output_len"] for r in results)
    return {"concurrency": concurrency, "num_prompts": num_prompts, "duration_s": duration,
            "image_throughput": num_prompts * args.images_per_prompt / duration,
            "request_throughput": num_prompts / duration, "output_throughput": output_tokens / duration,
            "mean_prompt_tokens": statistics.fmean(r["prompt_len"] for r in results),
            "output_len_mismatches": sum(r["output_len"] != n for r, (_, _, n) in zip(results, requests)),
            "ttft": summary_ms([r["ttft"] for r in results]),
            "tpot": summary_ms([r["tpot"] for r in results if r["tpot"] is not None])}


async def main_async(args) -> list[dict]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    t0 = time.perf_counter()
    limits = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                ("max_num_seqs", args.max_num_seqs)) if v is not None}
    # The server's usage context: its defaults for the step's token budget and batch (8192 and 1024 on an H200).
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model_dir, load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, seed=0, disable_log_stats=True,
        limit_mm_per_prompt={"image": args.images_per_prompt, "video": 0}, **limits),
        usage_context=UsageContext.OPENAI_API_SERVER)
    sc = engine.vllm_config.scheduler_config
    print(f"vllm vlm: engine ready in {time.perf_counter() - t0:.1f} s (max_num_batched_tokens "
          f"{sc.max_num_batched_tokens}, max_num_seqs {sc.max_num_seqs})", flush=True)
    try:
        (text, images, _), = make_requests(1, args.input_len, 2, args.image_size, args.images_per_prompt,
                                           seed=args.seed)
        warm = await one_request(engine, args.path, text, images, 2, "warm-up")
        print(f"vllm vlm: warm-up request {warm['e2e'] * 1e3:.0f} ms, {warm['prompt_len']} prompt tokens", flush=True)
        reports = []
        for concurrency, num_prompts in zip(args.concurrency, args.num_prompts):
            r = await run_level(engine, args, concurrency, num_prompts)
            reports.append(r)
            print(f"vllm vlm: concurrency {concurrency:3d}, {num_prompts} requests ({r['mean_prompt_tokens']:.0f} "
                  f"prompt tokens each, {args.images_per_prompt} x {args.image_size[0]}x{args.image_size[1]} image): "
                  f"{r['image_throughput']:.2f} images/s, {r['output_throughput']:.1f} output tok/s | TTFT p50 "
                  f"{r['ttft']['p50_ms']:.1f} ms p99 {r['ttft']['p99_ms']:.1f} ms | TPOT p50 {r['tpot']['p50_ms']:.2f} "
                  f"ms" + (f" | {r['output_len_mismatches']} output length mismatches"
                           if r["output_len_mismatches"] else ""), flush=True)
        return reports
    finally:
        engine.shutdown()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", help="config.json, preprocessor_config.json and a tokenizer (surge preset-dir)")
    p.add_argument("--concurrency", default="1,32", help="comma-separated levels")
    p.add_argument("--num-prompts", default="16,128", help="requests per level, comma-separated")
    p.add_argument("--input-len", type=int, default=64, help="words of text per request")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--image-size", default="1024x1024", metavar="WxH")
    p.add_argument("--images-per-prompt", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's server's")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's server's")
    p.add_argument("--path", choices=["chat", "prompt"], default="chat",
                   help="chat: vLLM's server path (renderer); prompt: text + multi_modal_data")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.num_prompts = [int(n) for n in args.num_prompts.split(",")]
    if len(args.concurrency) != len(args.num_prompts):
        p.error(f"--concurrency {args.concurrency} and --num-prompts {args.num_prompts} need one count per level")
    width, _, height = args.image_size.lower().partition("x")
    args.image_size = (int(width), int(height))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:  # before vLLM starts: its Qwen2-VL path loads transformers' processor, whose video half needs torchvision
        import torchvision  # noqa: F401
    except Exception as e:  # absent, or built for another torch (then not an ImportError)
        print("vllm vlm: not run: vLLM's Qwen2.5-VL path loads transformers' Qwen2_5_VLProcessor, whose video "
              f"processor needs torchvision ({type(e).__name__}: {str(e)[:200]}); carry a torchvision wheel built "
              "for this torch in .whl/ (scripts/h200's vlm-peer installs it beside vLLM)", flush=True)
        return 3
    reports = asyncio.run(main_async(args))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"engine": "vllm", "model_dir": args.model_dir, "path": args.path, "levels": reports}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
