"""`surge bench embed`: embedding throughput of the pooling runner (texts/s, tokens/s, prefill TFLOP/s and MFU against
a GEMM peak measured in the same run), beside sentence-transformers on the same token ids in the same process.

The peer is `SentenceTransformer(model)` for a sentence-transformers directory; for a random-weight preset, HF
transformers' model holding the engine's weights, then sentence-transformers' own Pooling and Normalize modules. It
runs padded batches of --st-batch-size (its encode()'s default is 32); tokenization is outside both timings. The
embeddings of both sides are compared (smallest cosine), so the figures are of the same computation.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from surge.bench.common import ActiveWeights, add_model_args, build_engine, make_workload, sync_device
from surge.bench.latency import measure_gemm_peak
from surge.core.request import Request
from surge.engine.core import EngineCore
from surge.engine.pooling import PROMPT_ONLY
from surge.pooling_params import PoolingParams

_ST_POOLING_MODES = {"LAST": "lasttoken", "MEAN": "mean", "CLS": "cls"}


def add_embed_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=256)
    g.add_argument("--input-len", type=int, default=256, help="(minimum, with --input-len-max) text length in tokens")
    g.add_argument("--input-len-max", type=int, default=None, help="lengths uniform in [input-len, this]")
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--repeats", type=int, default=1, help="timed runs of each side; the best is reported")
    g.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch size")
    g.add_argument("--no-st", action="store_true", help="skip the sentence-transformers peer")


def embed_all(engine: EngineCore, prompts: list[list[int]]) -> list[list[float]]:
    """Every prompt's embedding, through the engine's pooling runner."""
    block_size = engine.config.cache_config.block_size
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(str(i), prompt, PROMPT_ONLY, block_size, pooling_params=PoolingParams(task="embed")))
    out: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.pooling_output is not None:
                out[o.request_id] = o.pooling_output
    return [out[str(i)] for i in range(len(prompts))]


def prefill_flops(engine: EngineCore, prompts: list[list[int]]) -> float:
    """2 x the parameters each token passes through (no embedding lookup, no LM head) plus causal attention's
    QK^T and PV (2 x layers x heads x head_dim x L^2 per prompt, as `bench latency` counts it)."""
    mc = engine.config.model_config
    params = ActiveWeights.of(engine.executor.model).params_per_token
    params -= mc.vocab_size * mc.hidden_size  # the embedding: a lookup
    tokens = sum(map(len, prompts))
    attention = 2 * mc.num_layers * mc.text_config.num_attention_heads * mc.head_dim * sum(len(p) ** 2 for p in prompts)
    return 2 * params * tokens + attention


def _report(name: str, seconds: float, prompts: list[list[int]], flops: float, peak: float) -> float:
    tokens = sum(map(len, prompts))
    print(f"{name:>22}: {seconds:8.3f} s  {len(prompts) / seconds:9.1f} texts/s  {tokens / seconds:11.1f} tok/s  "
          f"{flops / seconds / 1e12:8.2f} TFLOP/s (MFU {flops / seconds / peak:6.1%})", flush=True)
    return tokens / seconds


def st_peer(engine: EngineCore):
    """(name, embed(batch of token id lists) -> [B, D] float tensor) of sentence-transformers on the same weights."""
    from pathlib import Path

    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    mc, device = engine.config.model_config, engine.config.device
    if (Path(mc.model) / "modules.json").is_file():
        st = SentenceTransformer(mc.model, device=str(device), model_kwargs={"dtype": mc.dtype}).eval()
        return "sentence-transformers", st
    from transformers import AutoConfig, AutoModel

    from surge.model.loader.safetensors_loader import load_weights

    cfg = dict(mc.hf_config)
    torch.manual_seed(engine.config.seed)
    with torch.device(device):
        hf = AutoModel.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=mc.dtype).eval()
    load_weights(engine.executor.model, hf.state_dict().items(), "HF model")  # both sides: the same weights
    pooler = mc.pooler_config
    pool = modules.Pooling(mc.hidden_size, pooling_mode=_ST_POOLING_MODES[pooler.type])
    norm = modules.Normalize() if pooler.normalize is not False else None

    def forward(features: dict) -> dict:
        features["token_embeddings"] = hf(input_ids=features["input_ids"],
                                          attention_mask=features["attention_mask"]).last_hidden_state
        features = pool(features)
        return norm(features) if norm is not None else features
    return "hf + st Pooling/Normalize", forward


def run_st(st, prompts: list[list[int]], batch_size: int, device: torch.device) -> torch.Tensor:
    outs = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in batch], device=device)
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch], device=device)
            outs.append(st({"input_ids": ids, "attention_mask": mask})["sentence_embedding"].float())
    return torch.cat(outs)


def _best(fn, repeats: int, device: torch.device):
    best, result = float("inf"), None
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        result = fn()
        sync_device(device)
        best = min(best, time.perf_counter() - start)
    return best, result


def run_embed(args: argparse.Namespace) -> None:
    # Off: a repeat (or the warm-up) would find the texts' KV cached and pool without computing them (the H200's
    # first run reported 10x the GEMM peak so).
    args.no_prefix_caching = True
    engine = build_engine(args)
    mc, device = engine.config.model_config, engine.config.device
    if mc.runner != "pooling" or mc.is_cross_encoder:
        raise ValueError(f"bench embed needs an embedding model on the pooling runner; {mc.model} runs "
                         f"runner={mc.runner!r}{' as a classifier' if mc.is_cross_encoder else ''}")
    prompts = [p for p, _ in make_workload(args.num_prompts, args.input_len, 1, 0.0, mc.vocab_size,
                                           args.workload_seed, args.input_len_max)]
    peak = measure_gemm_peak(device, mc.dtype)
    flops = prefill_flops(engine, prompts)
    print(f"model {mc.model} ({mc.dtype}, {device}, pooling {mc.pooler_config.type}); {len(prompts)} texts, "
          f"{sum(map(len, prompts))} tokens; {mc.dtype} GEMM peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    peer = None if args.no_st else st_peer(engine)  # before the timed runs: it may load the engine's weights
    embed_all(engine, prompts[:2])  # warm-up
    seconds, surge_out = _best(lambda: embed_all(engine, prompts), args.repeats, device)
    surge_rate = _report("surge", seconds, prompts, flops, peak)
    if peer is None:
        return
    name, st = peer
    run_st(st, prompts[:2], args.st_batch_size, device)  # warm-up
    seconds, st_out = _best(lambda: run_st(st, prompts, args.st_batch_size, device), args.repeats, device)
    st_rate = _report(f"{name} (batch {args.st_batch_size})", seconds, prompts, flops, peak)
    cosine = F.cosine_similarity(torch.tensor(surge_out, device=st_out.device), st_out, dim=-1).min().item()
    print(f"ratio surge / {name}: {surge_rate / st_rate:.2f}x tok/s; smallest cosine between their embeddings "
          f"{cosine:.6f}", flush=True)
