"""`surge bench throughput`: offline throughput on random-token prompts with ignore_eos, optionally side by side
with HF transformers `generate` on the same model, prompts and lengths, in the same process.

Prints requests/s, output and total tokens/s, and the compute rate the tokens imply (2 x params FLOP per token).
"""
from __future__ import annotations

import argparse
import time

import torch

from surge.entrypoints.cli.args import engine_kwargs


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len x (1 - r), len x (1 + r)] (0: fixed)")
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--compare-hf", action="store_true", help="also run HF transformers generate and print the ratio")
    g.add_argument("--hf-batch-size", type=int, default=None, help="HF generate batch size (default: all prompts)")


def make_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int) -> list[tuple[list[int], int]]:
    for name, value in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio={range_ratio} must be in [0, 1)")
    g = torch.Generator().manual_seed(seed)

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - range_ratio))), int(mean * (1 + range_ratio))
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    # Avoid the low ids, which are usually special tokens.
    return [(torch.randint(min(100, vocab_size // 2), vocab_size, (length(input_len),), generator=g).tolist(),
             length(output_len)) for _ in range(num_prompts)]


def _report(name: str, seconds: float, workload, num_params: int) -> float:
    out_tokens = sum(o for _, o in workload)
    total = out_tokens + sum(len(p) for p, _ in workload)
    tflops = 2 * num_params * total / seconds / 1e12
    print(f"{name:>12}: {seconds:8.2f} s  {len(workload) / seconds:8.2f} req/s  {out_tokens / seconds:10.1f} output "
          f"tok/s  {total / seconds:10.1f} total tok/s  ~{tflops * 1000:.1f} GFLOP/s (2 x params x tokens)")
    return out_tokens / seconds


def run_throughput(args: argparse.Namespace) -> None:
    from surge import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    mc = llm.config.model_config
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, mc.vocab_size,
                             args.workload_seed)
    num_params = sum(p.numel() for p in llm.engine.runner.model.parameters())
    print(f"model {mc.model} ({mc.architecture}, {num_params / 1e6:.0f}M params, {mc.dtype}, {llm.config.device}); "
          f"{len(workload)} prompts, input {args.input_len}, output {args.output_len}, range {args.range_ratio}")
    llm.generate([p[:8] for p, _ in workload[:2]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    # min_tokens masks EOS exactly as HF min_new_tokens does, so both runs make the same tokens.
    params = [SamplingParams(temperature=0, max_tokens=o, min_tokens=o, ignore_eos=True) for _, o in workload]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params)
    surge_rate = _report("surge", time.perf_counter() - start, workload, num_params)
    if not args.compare_hf:
        return
    hf_tokens, hf_seconds = _run_hf(mc, llm.config.device, workload, args.hf_batch_size or len(workload))
    hf_rate = _report("hf generate", hf_seconds, workload, num_params)
    same = sum(o.outputs[0].token_ids == t for o, t in zip(outputs, hf_tokens))
    print(f"ratio surge / hf: {surge_rate / hf_rate:.2f}x; greedy outputs identical to HF: {same}/{len(workload)}")


def _run_hf(mc, device, workload, batch_size: int) -> tuple[list[list[int]], float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mc.model, dtype=mc.dtype).to(device).eval()
    pad = mc.eos_token_ids[0] if mc.eos_token_ids else 0
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
    return results, time.perf_counter() - start
