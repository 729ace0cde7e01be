"""`surge bench prefix-reuse`: requests that share a long document prefix, one after another (a multi-turn user),
run cold (no prefix caching), with local prefix caching, with the offload tier after every request's prefix was
evicted from the KV cache, and (with --mooncake) from the Mooncake store after an engine restart; TTFT p50/p99,
prefill tokens computed, throughput, and what the hardware achieved (prefill TFLOP/s, KV load GB/s), side by side.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time

import torch

from surge.bench.common import add_model_args
from surge.core.request import Request
from surge.engine.args import EngineArgs
from surge.engine.core import EngineCore
from surge.sampling_params import SamplingParams


def add_prefix_reuse_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--prefix-len", type=int, default=4096, help="tokens of the shared document")
    g.add_argument("--suffix-len", type=int, default=64, help="tokens of each request's own question")
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--num-requests", type=int, default=8, help="measured requests (after one warm-up request)")
    g.add_argument("--offload-gib", type=float, default=8.0, help="size of the offload tier for its run")
    g.add_argument("--modes", default="cold,local,offload", help="comma-separated: cold, local, offload, mooncake")
    g.add_argument("--mooncake-config", default=None, help="kv_connector_extra_config JSON of the "
                   "MooncakeStoreConnector for the mooncake mode (its master must be running)")
    g.add_argument("--workload-seed", type=int, default=0)


def _workload(args, vocab_size: int) -> tuple[list[int], list[list[int]]]:
    for name in ("prefix_len", "suffix_len", "output_len", "num_requests"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    g = torch.Generator().manual_seed(args.workload_seed)
    low = min(100, vocab_size // 2)
    prefix = torch.randint(low, vocab_size, (args.prefix_len,), generator=g).tolist()
    prompts = [prefix + torch.randint(low, vocab_size, (args.suffix_len,), generator=g).tolist()
               for _ in range(args.num_requests + 1)]
    return prefix, prompts


def _engine(base: EngineArgs, **changes) -> EngineCore:
    return EngineCore(dataclasses.replace(base, **changes).create_engine_config())


def _release(engine: EngineCore) -> None:
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _serve_one(engine: EngineCore, rid: str, prompt: list[int],
               params: SamplingParams) -> tuple[float, list[int], int]:
    """(TTFT seconds, tokens generated, prompt tokens served from caches) for one request run alone."""
    start = time.perf_counter()
    engine.add_request(Request(rid, prompt, params, engine.config.cache_config.block_size))
    ttft, generated, cached = None, [], 0
    for _ in range(100_000):  # bounded: a request of output_len tokens needs far fewer steps
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.request_id != rid:
                continue
            cached = max(cached, o.num_cached_tokens)
            if o.new_token_ids and ttft is None:
                # The token is on the host: the device work that made it is done. (A synchronize here would also
                # wait for the next step, already launched under async scheduling: ~5 ms of decode at 8B.)
                ttft = time.perf_counter() - start
            generated += o.new_token_ids
    return ttft if ttft is not None else float("nan"), generated, cached


def _run_mode(mode: str, base: EngineArgs, args, prompts: list[list[int]], params: SamplingParams) -> dict:
    changes = {"cold": lambda: dict(enable_prefix_caching=False), "local": dict,
               "offload": lambda: dict(kv_offload_gib=args.offload_gib),
               "mooncake": lambda: dict(kv_transfer_config={"kv_connector": "MooncakeStoreConnector",
                                                            "kv_role": "kv_both",
                                                            "kv_connector_extra_config": _json(args.mooncake_config)})}
    if mode not in changes:
        raise ValueError(f"--modes: {mode!r} is not one of {', '.join(changes)}")
    engine = _engine(base, **changes[mode]())
    _serve_one(engine, "warm-up", prompts[0], params)  # compiles, and leaves the prefix where the mode keeps it
    if mode == "mooncake":  # a restart: a new engine finds the prefix only in the store
        _release(engine)
        engine = _engine(base, **changes[mode]())
    ttfts, tokens, computed = [], [], 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts[1:]):
        if mode in ("offload", "mooncake"):
            engine.kv_cache_manager.reset_prefix_cache()  # evicted from the KV cache: only the tier has it
        ttft, out, cached = _serve_one(engine, f"r{i}", prompt, params)
        ttfts.append(ttft)
        tokens.append(out)
        computed += len(prompt) - cached
    generated = sum(len(t) for t in tokens)
    seconds = time.perf_counter() - start
    stats = engine.kv_connector.stats if engine.kv_connector is not None else None
    num_params = sum(p.numel() for p in engine.executor.model.parameters())
    result = {"mode": mode, "ttft_p50": statistics.median(ttfts), "ttft_p99": _p99(ttfts), "computed": computed,
              "out_tok_s": generated / seconds, "prefill_tflops": 2 * num_params * computed / sum(ttfts) / 1e12,
              "load_gbs": (stats.loaded_bytes / stats.load_seconds / 1e9) if stats and stats.load_seconds else None,
              "external_hit_tokens": stats.external_hit_tokens if stats else 0, "tokens": tokens}
    _release(engine)
    return result


def _json(text: str | None) -> dict:
    import json
    if text is None:
        raise ValueError("--modes mooncake needs --mooncake-config (the connector's kv_connector_extra_config)")
    return json.loads(text)


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def run_prefix_reuse(args: argparse.Namespace) -> list[dict]:
    base = EngineArgs.from_cli_args(args)
    if base.preset:
        base = dataclasses.replace(base, load_format="dummy")
    vocab = base.create_engine_config().model_config.vocab_size
    _, prompts = _workload(args, vocab)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    print(f"prefix-reuse: {args.num_requests} requests, one after another: a {args.prefix_len}-token shared prefix "
          f"+ {args.suffix_len} own tokens, {args.output_len} out", flush=True)
    results = [_run_mode(m.strip(), base, args, prompts, params) for m in args.modes.split(",") if m.strip()]
    cold = next((r for r in results if r["mode"] == "cold"), None)
    for r in results:
        ratio = f"  {r['ttft_p50'] / cold['ttft_p50']:.3f}x cold TTFT" if cold else ""
        if cold and r is not cold:  # greedy: the same tokens, up to the dtype's rounding of a different prefill
            same = sum(a == b for a, b in zip(r["tokens"], cold["tokens"]))
            ratio += f", outputs as cold {same}/{len(cold['tokens'])}"
        load = f"  KV load {r['load_gbs']:.1f} GB/s" if r["load_gbs"] else ""
        print(f"{r['mode']:>9}: TTFT p50 {r['ttft_p50'] * 1e3:8.1f} ms  p99 {r['ttft_p99'] * 1e3:8.1f} ms  "
              f"prefill computed {r['computed']:7d} tokens  {r['out_tok_s']:8.1f} output tok/s  prefill "
              f"{r['prefill_tflops']:.1f} TFLOP/s{load}  external hits {r['external_hit_tokens']}{ratio}",
              flush=True)
    return results
