"""One-off: the CUDA kernels of a 64 x 128-token fp8 prefill (scripts/h200 fp8-prefill-profile)."""
import argparse
import sys

from torch.profiler import ProfilerActivity, profile

from surge.bench.common import build_engine, make_workload, run_engine
from surge.bench.latency import add_latency_args

p = argparse.ArgumentParser()
add_latency_args(p)
args = p.parse_args(sys.argv[1:])
engine = build_engine(args)
wl = [(prompt, 1) for prompt, _ in make_workload(64, 128, 1, 0.0, engine.config.model_config.vocab_size, 64)]
run_engine(engine, wl, show_progress=False)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    run_engine(engine, wl, show_progress=False)
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70))
