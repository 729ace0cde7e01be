"""`surge bench throughput`: offline throughput on random-token prompts (exact output lengths, EOS ignored),
optionally side by side with HF transformers on the same weights and workload, in the same process.

The HF peer is `generate` (static batches, left-padded) on CPU and `generate_batch`-style continuous batching on
CUDA. Prints requests/s, output and total tokens/s, and the compute rate the tokens imply (2 x params FLOP/token;
of a mixture of experts, the params each token is routed through). `--batch-sizes 16,1` runs the workload in waves
of each size on both sides and prints one ratio per size; `--repeats N` times each side N times in turn, keeping
the best, so one command gives figures a busy machine cannot skew toward either side.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from surge.bench.common import (ActiveWeights, add_model_args, build_engine, hf_model_for, make_workload, run_engine,
                                sync_device)
from surge.bench.lora import LoRABench, add_lora_bench_args, make_lora_bench, resolve_lora_args, warm_up_adapters


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--input-len", type=int, default=128, help="(minimum, with --input-len-max) prompt length")
    g.add_argument("--output-len", type=int, default=128, help="(minimum, with --output-len-max) output length")
    g.add_argument("--input-len-max", type=int, default=None, help="prompt lengths uniform in [input-len, this]")
    g.add_argument("--output-len-max", type=int, default=None, help="output lengths uniform in [output-len, this]")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len x (1 - r), len x (1 + r)] (0: fixed)")
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--compare-hf", action="store_true", help="also run HF transformers and print the ratio")
    g.add_argument("--hf-batch-size", type=int, default=None, help="HF generate batch size (default: all prompts)")
    g.add_argument("--batch-sizes", default=None, metavar="B1,B2,...",
                   help="run the workload in waves of B requests for each B, Surge and HF alike, and print a ratio "
                   "for each (e.g. 16,1)")
    g.add_argument("--repeats", type=int, default=1, help="timed runs of each side, Surge and HF in turn; the best "
                   "of each is reported (a shared machine's noise only ever slows a run down)")
    g.add_argument("--hf-time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop HF generate_batch (CUDA) after this long and rate it by the output tokens it streamed "
                   "so far, finished or not: its ramp-up is in the window, its thinning tail is not, so the ratio "
                   "errs toward HF")
    add_lora_bench_args(p)


def _report(name: str, seconds: float, out_tokens: int, in_tokens: int, num_requests: int,
            num_params: float) -> float:
    total = out_tokens + in_tokens
    tflops = 2 * num_params * total / seconds / 1e12
    print(f"{name:>16}: {seconds:8.2f} s  {num_requests / seconds:8.2f} req/s  {out_tokens / seconds:10.1f} output "
          f"tok/s  {total / seconds:10.1f} total tok/s  {tflops:8.3f} TFLOP/s (2 x active params x tokens)", flush=True)
    return out_tokens / seconds


def parse_batch_sizes(text: str | None) -> list[int | None]:
    """"16,1" -> [16, 1]; None -> [None] (every prompt at once)."""
    if text is None:
        return [None]
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes={text!r} must be comma-separated integers, e.g. 16,1") from None
    if min(sizes) < 1:
        raise ValueError(f"--batch-sizes={text!r}: every batch size must be >= 1")
    return sizes


def _waves(workload: list, size: int | None) -> list[list]:
    size = size or len(workload)
    return [workload[i:i + size] for i in range(0, len(workload), size)]


def run_throughput(args: argparse.Namespace) -> None:
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")
    if args.hf_time_limit is not None and not args.hf_time_limit > 0:
        raise ValueError(f"--hf-time-limit={args.hf_time_limit:g} must be > 0 seconds")
    sizes = parse_batch_sizes(args.batch_sizes)
    resolve_lora_args(args)
    if getattr(args, "num_lora_adapters", 0) and args.compare_hf:
        raise ValueError("--compare-hf runs the base model: give it or --num-lora-adapters, not both")
    engine = build_engine(args)
    mc = engine.config.model_config
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, mc.vocab_size,
                             args.workload_seed, args.input_len_max, args.output_len_max)
    weights = ActiveWeights.of(engine.executor.model)
    num_params = weights.params_per_token  # a mixture of experts: top-k experts per token
    in_tokens, out_tokens = sum(len(p) for p, _ in workload), sum(o for _, o in workload)
    active = f", {num_params / 1e9:.2f}B active per token" if weights.num_experts else ""
    threads = f", {torch.get_num_threads()} threads" if engine.config.device.type == "cpu" else ""
    print(f"model {mc.model} ({mc.architecture}, {weights.params / 1e9:.2f}B params{active}, {mc.dtype}, "
          f"{engine.config.device}{threads}); {len(workload)} prompts, {in_tokens} input and {out_tokens} output "
          f"tokens; engine ready in {engine.startup_seconds:.1f} s", flush=True)
    lora = make_lora_bench(engine, args)
    if lora is not None:
        print(f"{lora.describe()}; warm-up loading them {warm_up_adapters(engine, lora, mc.vocab_size):.1f} s",
              flush=True)
        for size in sizes:
            _lora_throughput(engine, workload, size, lora, args.repeats, num_params, weights.nbytes)
        return
    hf = hf_model_for(engine) if args.compare_hf else None  # the engine takes HF's weights: same model
    run_engine(engine, [(p[:8], 2) for p, _ in workload[:2]], show_progress=False)  # warm-up
    for size in sizes:
        label = "" if size is None else f" (batch {size})"
        surge_seconds = float("inf")
        hf_run = None
        for repeat in range(args.repeats):  # in turn, so both sides see the same spells of load
            seconds, outputs = _run_surge(engine, workload, size)
            surge_seconds = min(surge_seconds, seconds)
            if repeat == args.repeats - 1:  # before HF's last run, which may be long
                surge_rate = _report("surge" + label, surge_seconds, out_tokens, in_tokens, len(workload), num_params)
            if hf is not None:
                run = _run_hf(hf, engine, workload, size or args.hf_batch_size, args.hf_time_limit)
                hf_run = run if hf_run is None or run.rate > hf_run.rate else hf_run
        if hf_run is None:
            continue
        name = "hf generate_batch" if engine.config.device.type == "cuda" else "hf generate"
        finished = [i for i, t in enumerate(hf_run.tokens) if t is not None]
        hf_in = sum(len(workload[i][0]) for i in finished) if hf_run.cut_off else in_tokens
        hf_rate = _report(name + label, hf_run.seconds, hf_run.out_tokens, hf_in, len(finished), num_params)
        if hf_run.cut_off:
            print(f"  hf cut off at --hf-time-limit {args.hf_time_limit:g} s: {len(finished)}/{len(workload)} requests "
                  f"finished, {hf_run.out_tokens} of {out_tokens} output tokens streamed (the rate counts them all)",
                  flush=True)
        same = sum(outputs[i] == hf_run.tokens[i] for i in finished)
        best = f", best of {args.repeats} runs each" if args.repeats > 1 else ""
        print(f"ratio surge / hf{label}: {surge_rate / hf_rate:.2f}x output tok/s{best}; greedy outputs identical "
              f"to HF: {same}/{len(finished)}", flush=True)


def _lora_throughput(engine, workload, size: int | None, lora: LoRABench, repeats: int, num_params: float,
                     weight_bytes: int) -> None:
    """The workload without adapters and round-robin over them, in turn, best of `repeats` each; the ratio."""
    in_tokens, out_tokens = sum(len(p) for p, _ in workload), sum(o for _, o in workload)
    label = "" if size is None else f" (batch {size})"
    tag = f"lora{len(lora.requests)}"
    loras = lora.round_robin(len(workload))
    best = {"base": float("inf"), tag: float("inf")}
    outputs = {}
    for _ in range(repeats):
        for name in best:
            seconds, outputs[name] = _run_surge(engine, workload, size, None if name == "base" else loras)
            best[name] = min(best[name], seconds)
    rates = {name: _report(f"surge {name}{label}", seconds, out_tokens, in_tokens, len(workload), num_params)
             for name, seconds in best.items()}
    k = lora.distinct(size or len(workload))
    extra = k * lora.adapter_bytes
    print(f"ratio {tag} / base{label}: {rates[tag] / rates['base']:.3f} output tok/s; a full step reads {k} "
          f"adapter(s), {extra / 1e6:.1f} MB more than the {weight_bytes / 1e9:.2f} GB of weights "
          f"(+{extra / weight_bytes:.1%}); outputs that differ from the base model's: "
          f"{sum(a != b for a, b in zip(outputs['base'], outputs[tag]))}/{len(workload)}", flush=True)


def _run_surge(engine, workload, size: int | None, loras=None) -> tuple[float, list[list[int]]]:
    """Seconds and output tokens of the workload, in waves of `size` requests (all at once for None); loras: each
    request's adapter."""
    engine.kv_cache_manager.reset_prefix_cache()  # a repeat must not hit the prompts of the run before
    sync_device(engine.config.device)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    first = 0
    for wave in _waves(workload, size):
        done = run_engine(engine, wave, show_progress=size is None,
                          loras=None if loras is None else loras[first:first + len(wave)])
        first += len(wave)
        outputs.extend(done[str(i)] for i in range(len(wave)))
    sync_device(engine.config.device)
    return time.perf_counter() - start, outputs


@dataclass
class HFRun:
    """One HF run: its seconds, each request's output tokens (None: unfinished at the time limit), and the output
    tokens it produced (unfinished requests' streamed ones included)."""
    seconds: float
    tokens: list[list[int] | None]
    out_tokens: int
    cut_off: bool = False

    @property
    def rate(self) -> float:
        return self.out_tokens / self.seconds


def _run_hf(model, engine, workload, size: int | None, time_limit: float | None = None) -> HFRun:
    """Static batches of `size` on CPU, continuous waves on CUDA (within `time_limit` seconds in all)."""
    if engine.config.device.type != "cuda":
        if time_limit is not None:
            raise ValueError("--hf-time-limit applies to HF generate_batch on CUDA; HF generate on CPU runs whole")
        tokens, seconds, count = _run_hf_static(model, workload, size, engine.config.model_config.eos_token_ids)
        return HFRun(seconds, tokens, count)
    total = HFRun(0.0, [], 0)
    for wave in _waves(workload, size):
        left = None if time_limit is None else time_limit - total.seconds
        if left is not None and left <= 0:
            total.tokens.extend([None] * len(wave))
            total.cut_off = True
            continue
        run = _run_hf_continuous(model, wave, left)
        total = HFRun(total.seconds + run.seconds, total.tokens + run.tokens, total.out_tokens + run.out_tokens,
                      total.cut_off or run.cut_off)
    return total


def _run_hf_static(model, workload, batch_size: int | None, eos_ids) -> tuple[list[list[int]], float, int]:
    """HF generate in padded batches; every sequence of a batch runs to the batch's longest output."""
    batch_size = batch_size or len(workload)
    device = next(model.parameters()).device
    pad = eos_ids[0] if eos_ids else 0
    results: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(workload), batch_size):
            batch = workload[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            new = max(o for _, o in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
            results.extend(out[j, width:width + o].tolist() for j, (_, o) in enumerate(batch))
    return results, time.perf_counter() - start, sum(o for _, o in workload)


def _run_hf_continuous(model, workload, time_limit: float | None = None) -> HFRun:
    """HF transformers' continuous batching (the engine behind `generate_batch`), one max_new_tokens per request.
    With a time limit, requests stream their tokens so that the unfinished ones' count too when it runs out."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in workload), eos_token_id=None,
                           pad_token_id=0)
    results: dict[str, list[int]] = {}
    streamed: dict[str, int] = {}  # request id -> tokens so far (a streamed result carries all of them)
    stream = time_limit is not None
    start = time.perf_counter()
    deadline = start + (3600 if time_limit is None else time_limit)
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=5) as manager:
        for i, (prompt, out_len) in enumerate(workload):
            manager.add_request(prompt, request_id=str(i), max_new_tokens=out_len, streaming=stream)
        while len(results) < len(workload) and time.perf_counter() < deadline:
            r = manager.get_result(timeout=min(1.0, max(deadline - time.perf_counter(), 0.01)))
            if r is None:
                continue
            streamed[r.request_id] = len(r.generated_tokens)
            if r.is_finished():
                results[r.request_id] = list(r.generated_tokens)
        seconds = time.perf_counter() - start  # before the manager's stop, which waits for its running step
        if len(results) < len(workload) and hasattr(manager, "cancel_request"):  # cut off: the rest is not wanted
            for i in range(len(workload)):
                if str(i) not in results:
                    manager.cancel_request(str(i))
    tokens = [results.get(str(i)) for i in range(len(workload))]
    out = sum(len(t) for t in results.values()) + sum(n for k, n in streamed.items() if k not in results)
    return HFRun(seconds, tokens, out, cut_off=len(results) < len(workload))
