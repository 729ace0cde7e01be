"""`surge bench latency`: per batch size, prefill time and time per output token, with what the hardware achieved:
decode GB/s (weights + KV read per step; of a mixture of experts, the experts reached) and MBU against a copy
bandwidth measured in the same run, prefill TFLOP/s and MFU against a GEMM peak measured in the same run; for a
multimodal model, the vision encoder's time per image (--image-size)."""
from __future__ import annotations

import argparse
import time

import msgspec

import torch

from surge.bench.common import (ActiveWeights, add_model_args, build_engine, hf_model_for, make_workload,
                                parse_image_size, random_image, run_engine, sync_device)
from surge.bench.lora import add_lora_bench_args, make_lora_bench, resolve_lora_args, warm_up_adapters
from surge.bench.speculative import add_speculative_args, run_speculative_latency


def add_latency_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,8,32")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=256)
    g.add_argument("--repeats", type=int, default=2, help="timed runs per case (the best is reported)")
    g.add_argument("--compare-hf", action="store_true", help="also time HF transformers generate (batch 1 decode)")
    g.add_argument("--image-size", default="1024x1024", metavar="WxH",
                   help="a multimodal model: the size of the random images its encoder time per image is taken on")
    g.add_argument("--breakdown", action="store_true",
                   help="split each decode step into device time (forward, logits + sampling) and host time")
    add_speculative_args(g)  # with --speculative-config: with and without it, in one run
    add_lora_bench_args(p)  # with --num-lora-adapters: with and without adapters, in one engine


def measure_copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync_device(device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        sync_device(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n / best


def measure_gemm_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in the model's dtype."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync_device(device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        sync_device(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def _timed(engine, workload, repeats: int, loras=None) -> float:
    best = float("inf")
    for _ in range(repeats):
        engine.kv_cache_manager.reset_prefix_cache()
        sync_device(engine.config.device)
        start = time.perf_counter()
        run_engine(engine, workload, show_progress=False, loras=loras)
        sync_device(engine.config.device)
        best = min(best, time.perf_counter() - start)
    return best


def run_latency(args: argparse.Namespace) -> None:
    resolve_lora_args(args)
    if getattr(args, "speculative_config", None) is not None:
        if getattr(args, "num_lora_adapters", 0):
            raise ValueError("--num-lora-adapters and --speculative-config: give one of them (each compares the "
                             "engine with and without it)")
        return run_speculative_latency(args)
    engine = build_engine(args)
    mc, dev = engine.config.model_config, engine.config.device
    weights = ActiveWeights.of(engine.executor.model)
    params, weight_bytes = weights.params, weights.nbytes
    embed = mc.vocab_size * mc.hidden_size  # the language model's (a VLM nests it in text_config)
    # Per prompt token: the embedding is a lookup, the LM head runs once per sequence in prefill; a mixture of
    # experts multiplies each token by its top-k experts only.
    dense_params = weights.params_per_token - embed
    if not mc.hf_config.get("tie_word_embeddings"):
        dense_params -= embed
    kv_bytes_per_token, kv_line = _kv_cache_per_token(engine)
    copy_bw = measure_copy_bandwidth(dev)
    peak = measure_gemm_peak(dev, mc.dtype)
    active = (f", {weights.params_per_token / 1e9:.2f}B active per token: MBU counts the experts a decode step "
              f"reaches, top-{weights.top_k} of {weights.num_experts} per layer for one token and the expectation "
              "under uniform routing for more" if weights.num_experts else "")
    print(f"model {mc.model} ({params / 1e9:.2f}B params{active}, {weight_bytes / 1e9:.2f} GB, {mc.dtype}, {dev}); "
          f"engine ready in {engine.startup_seconds:.1f} s; measured copy bandwidth {copy_bw / 1e9:.0f} GB/s, "
          f"{mc.dtype} GEMM peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    print(kv_line, flush=True)
    lora = make_lora_bench(engine, args)
    if lora is not None:  # peer_breadth's: every adapter loaded first, and each batch's workload of seed 0
        print(f"{lora.describe()}; warm-up loading them {warm_up_adapters(engine, lora, mc.vocab_size):.1f} s",
              flush=True)
    else:
        run_engine(engine, make_workload(2, 16, 4, 0, mc.vocab_size, 1), show_progress=False)  # warm-up
    _encoder_latency(engine, parse_image_size(args.image_size), args.repeats)
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        workload = make_workload(bs, args.input_len, args.output_len, 0.0, mc.vocab_size, 0 if lora else bs)
        cases = [("", None, 0)] if lora is None else [
            (" base", None, 0), (f" lora{lora.distinct(bs)}", lora.round_robin(bs), lora.distinct(bs))]
        rates = []
        for tag, loras, num_adapters in cases:
            prefill = _timed(engine, [(p, 1) for p, _ in workload], args.repeats, loras)
            total = _timed(engine, workload, args.repeats, loras)
            tpot = (total - prefill) / max(args.output_len - 1, 1)
            rates.append(bs / tpot)
            ctx = args.input_len + args.output_len / 2
            adapter_bytes = num_adapters * lora.adapter_bytes if num_adapters else 0
            decode_bytes = weights.step_bytes(bs) + bs * ctx * kv_bytes_per_token + adapter_bytes
            tokens = bs * args.input_len
            flops = 2 * dense_params * tokens + 2 * bs * embed
            flops += 2 * mc.num_layers * mc.text_config.num_attention_heads * mc.head_dim * bs * args.input_len ** 2
            read = f", {adapter_bytes / 1e6:.1f} MB of it adapters" if adapter_bytes else ""
            print(f"batch {bs:4d}{tag} in {args.input_len} out {args.output_len}: prefill {prefill * 1e3:8.1f} ms "
                  f"{flops / prefill / 1e12:7.1f} TFLOP/s (MFU {flops / prefill / peak:5.1%}) | decode "
                  f"{tpot * 1e3:7.2f} ms/step {bs / tpot:9.1f} tok/s {decode_bytes / tpot / 1e9:7.0f} GB/s "
                  f"(MBU {decode_bytes / tpot / copy_bw:5.1%}; {decode_bytes / 1e9:.2f} GB read per step{read})",
                  flush=True)
            if args.breakdown and loras is None:
                _breakdown(engine, workload, tpot)
        if lora is not None:
            print(f"batch {bs} ratio{cases[1][0]} / base (decode tok/s): {rates[1] / rates[0]:.3f}", flush=True)
    if args.compare_hf:
        _compare_hf(engine, args)


def _kv_cache_per_token(engine) -> tuple[int, str]:
    """Bytes of KV cache per token over the whole model, from its layers' own cache specs (an MLA layer caches its
    latent and rope key, not per-head keys and values), and a line with the tokens a GB holds; for MLA layers also
    beside a plain multi-head cache of the same model (keys of qk_head_dim and values of v_head_dim per head), the
    point of the latent cache."""
    from surge.worker.model_runner import layer_kv_specs

    model, config = engine.executor.model, engine.config
    specs = layer_kv_specs(model, config)
    per_token = sum(spec.page_size_bytes // spec.block_size for spec in specs)
    line = f"KV cache: {per_token} bytes per token ({len(specs)} layers), {1e9 / per_token:,.0f} tokens per GB"
    mla = [attn.params for attn in model.attention_layers() if attn.params.is_mla]
    if mla:
        itemsize = specs[0].dtype.itemsize
        mha = sum(p.num_heads * (p.head_dim + p.head_dim_v) * itemsize for p in mla)
        mha += sum(spec.page_size_bytes // spec.block_size for spec, attn in zip(specs, model.attention_layers())
                   if not attn.params.is_mla)
        line += (f"; a plain MHA cache of this model: {mha} bytes per token, {1e9 / mha:,.0f} tokens per GB "
                 f"(the latent cache holds {mha / per_token:.1f}x the tokens)")
    return per_token, line


def _encoder_latency(engine, size: tuple[int, int], repeats: int) -> None:
    """A multimodal model's vision encoder (the runner's path: processed pixels -> embeddings) per image, at batch 1
    and 8 distinct images, best of repeats; nothing for a text-only model."""
    from surge.engine.input_processor import InputProcessor
    from surge.worker.encoder_cache import EncoderCache

    runner = getattr(engine.executor, "runner", None)
    if runner is None or not hasattr(runner.model, "embed_images"):
        return
    processor = InputProcessor(engine.config, tokenizer=None)
    try:
        placeholder = processor.image_placeholder()
        _, [feature] = processor.process_images(placeholder, {"image": [random_image(size, 0)]},
                                                add_special_tokens=False)
    except ValueError as e:  # a preset has no processor files
        print(f"encoder: not measured ({e})", flush=True)
        return
    device = engine.config.device
    times = {}
    for batch in (1, 8):
        # Distinct identifiers, so the cache encodes every one.
        needed = [(f"r{i}", msgspec.structs.replace(feature, identifier=f"bench-{i}")) for i in range(batch)]
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first is a warm-up
                cache = EncoderCache(device)
                sync_device(device)
                start = time.perf_counter()
                cache.encode(runner.model, needed)
                sync_device(device)
                best = min(best, time.perf_counter() - start)
        times[batch] = best / batch
    print(f"encoder: {size[0]}x{size[1]} image -> {feature.length} tokens: {times[1] * 1e3:.2f} ms per image at "
          f"batch 1, {times[8] * 1e3:.2f} ms per image at batch 8 ({1 / times[8]:.1f} images/s)", flush=True)


class _PhaseTimer:
    """Wall seconds spent inside one bound method, summed over calls."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.seconds, self.calls = owner, name, 0.0, 0
        self.inner = getattr(owner, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return self.inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.inner)


def _device_ms(fn, iters: int = 50) -> float:
    """Milliseconds of device time per call of fn, launched back to back (no host gaps between calls)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _breakdown(engine, workload, tpot: float) -> None:
    """Where a decode step's time goes: the graph's device time, the logits and sampling, and the host."""
    runner = getattr(engine.executor, "runner", None)
    graphs = runner.graph_runner if runner is not None else None
    bs = len(workload)
    if engine.config.device.type != "cuda" or graphs is None or graphs.padded_size(bs) is None:
        print("breakdown: needs CUDA, CUDA graphs and the in-process runner (tensor_parallel_size 1)", flush=True)
        return
    timers = [_PhaseTimer(engine.scheduler, "schedule"), _PhaseTimer(runner, "execute_async"),
              _PhaseTimer(engine.scheduler, "update_from_output")]
    engine.kv_cache_manager.reset_prefix_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    run_engine(engine, workload, show_progress=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    for t in timers:
        t.restore()
    steps = timers[0].calls
    with torch.inference_mode():
        forward = _device_ms(lambda: graphs.graphs[graphs.padded_size(bs)].replay())
        hidden = graphs.outputs[graphs.padded_size(bs)][:bs]
        logits = _device_ms(lambda: runner.model.compute_logits(hidden).float().argmax(dim=-1))
    per_step = {t.name: t.seconds / steps * 1e3 for t in timers}
    rest = wall / steps * 1e3 - sum(per_step.values())
    print(f"  breakdown, batch {bs}, {steps} steps, {wall / steps * 1e3:.3f} ms/step wall (decode {tpot * 1e3:.3f}): "
          f"device: forward graph {forward:.3f} ms + logits/argmax {logits:.3f} ms = {forward + logits:.3f} ms; "
          f"host ({'async' if engine.async_scheduling else 'sync'} scheduling): schedule {per_step['schedule']:.3f}, "
          f"launch {per_step['execute_async']:.3f}, update {per_step['update_from_output']:.3f}, waiting for the "
          f"device and the rest {rest:.3f} ms",
          flush=True)
    _kernel_table(runner, graphs, bs)


def _kernel_table(runner, graphs, bs: int) -> None:
    """Device time per kernel of one eager decode forward (graphs hide their kernels from the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    inp = runner.inputs
    meta = graphs._meta(graphs.padded_size(bs))
    with torch.inference_mode():
        runner.model(inp.input_ids[:bs], inp.positions[:bs], meta)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.model(inp.input_ids[:bs], inp.positions[:bs], meta)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=60),
          flush=True)


def _compare_hf(engine, args) -> None:
    mc = engine.config.model_config
    hf = hf_model_for(engine)
    prompt, _ = make_workload(1, args.input_len, args.output_len, 0, mc.vocab_size, 7)[0]
    ids = torch.tensor([prompt], device=engine.config.device)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, do_sample=False)
        sync_device(engine.config.device)
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
        sync_device(engine.config.device)
    hf_seconds = time.perf_counter() - start
    engine.kv_cache_manager.reset_prefix_cache()
    start = time.perf_counter()
    ours = run_engine(engine, [(prompt, args.output_len)], show_progress=False)["0"]
    sync_device(engine.config.device)
    seconds = time.perf_counter() - start
    same = ours == out[0, len(prompt):].tolist()
    print(f"batch 1, {args.output_len} tokens: surge {args.output_len / seconds:.1f} tok/s, HF generate "
          f"{args.output_len / hf_seconds:.1f} tok/s, ratio {hf_seconds / seconds:.2f}x; greedy identical: {same}")
