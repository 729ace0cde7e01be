"""One-off: the CUDA kernels of a prefill or a decode run, with or without LoRA adapters (scripts/h200 prof-*).

  python3 scripts/prof_step.py --preset qwen3-8b --dtype bfloat16 [--quantization fp8] [--num-lora-adapters 8]
      --prof-batch 64 --prof-input-len 128 --prof-output-len 1|16 [--enforce-eager] ...latency flags

Prints the top kernels by device time over the profiled run, and the device time per step. With adapters, request i
runs adapter i mod N (the benchmark's round robin); the same workload without adapters is profiled beside it.
"""
import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from surge.bench.common import build_engine, make_workload, run_engine
from surge.bench.latency import add_latency_args
from surge.bench.lora import make_lora_bench, resolve_lora_args, warm_up_adapters
from surge.engine.args import EngineArgs

p = argparse.ArgumentParser()
EngineArgs.add_cli_args(p)
add_latency_args(p)
p.add_argument("--prof-batch", type=int, default=64)
p.add_argument("--prof-input-len", type=int, default=128)
p.add_argument("--prof-output-len", type=int, default=1)
p.add_argument("--rows", type=int, default=16)
args = p.parse_args(sys.argv[1:])
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # the CPU run checks the script
activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
resolve_lora_args(args)
engine = build_engine(args)
vocab = engine.config.model_config.vocab_size
lora = make_lora_bench(engine, args)
if lora is not None:
    warm_up_adapters(engine, lora, vocab)
wl = make_workload(args.prof_batch, args.prof_input_len, args.prof_output_len, 0.0, vocab, 64)
cases = [("base", None)] + ([] if lora is None else [(f"lora x{lora.distinct(args.prof_batch)}",
                                                        lora.round_robin(args.prof_batch))])
for tag, loras in cases:
    run_engine(engine, wl, show_progress=False, loras=loras)
    engine.kv_cache_manager.reset_prefix_cache()
    sync()
    with profile(activities=activities) as prof:
        run_engine(engine, wl, show_progress=False, loras=loras)
        sync()
    engine.kv_cache_manager.reset_prefix_cache()
    events = prof.key_averages()
    total_us = sum(e.self_device_time_total for e in events)
    print(f"=== {tag}: batch {args.prof_batch} x {args.prof_input_len} in, {args.prof_output_len} out: "
          f"{total_us / 1e3:.2f} ms of kernels in all, {total_us / 1e3 / max(args.prof_output_len, 1):.3f} ms a step "
          "(the prefill's included)", flush=True)
    print(events.table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total", row_limit=args.rows, max_name_column_width=70), flush=True)
