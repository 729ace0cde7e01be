"""`surge bench parity`: greedy output of the engine against HF transformers `generate` on the same weights, one
unpadded prompt at a time (HF's plainest path), and where they part, how close the choice was.

For a prompt that diverges, HF scores the engine's own continuation (teacher forcing) and the first differing
position reports HF's top logit against HF's logit for the engine's token: a gap within rounding noise is a
near-tie, a large one a bug. `--hf-self-check` also runs HF with eager attention, a noise floor measured in the
same run: how often two correct implementations part at this dtype on these weights.
"""
from __future__ import annotations

import argparse
import copy

import torch

from surge.bench.common import add_model_args, build_engine, hf_model_for, make_workload, run_engine


def add_parity_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=4)
    g.add_argument("--input-len", type=int, default=64, help="minimum prompt length")
    g.add_argument("--input-len-max", type=int, default=200, help="prompt lengths uniform in [input-len, this]")
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--hf-self-check", action="store_true",
                   help="also run HF with eager attention: how often HF parts from itself (the noise floor)")
    g.add_argument("--fp32-reference", action="store_true",
                   help="score both outputs against a float32 copy of the model: at how many positions each picked "
                        "the float32 argmax, given its own tokens so far")


def _hf_greedy(hf, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    device = next(hf.parameters()).device
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def _agrees_with(ref, prompt: list[int], tokens: list[int]) -> int:
    """Positions where `tokens` is the argmax of `ref` given the prompt and the tokens before it."""
    device = next(ref.parameters()).device
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + tokens[:-1]], device=device)).logits[0, len(prompt) - 1:]
    return int((logits.argmax(dim=-1).cpu() == torch.tensor(tokens)).sum())


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _divergence_report(hf, prompt: list[int], ours: list[int], theirs: list[int], pos: int) -> str:
    """HF's logits at the first differing position, given the shared prefix."""
    device = next(hf.parameters()).device
    ids = torch.tensor([prompt + ours[:pos]], device=device)
    with torch.inference_mode():
        logits = hf(ids).logits[0, -1].float()
    top2 = logits.topk(2)
    ours_logit = logits[ours[pos]].item()
    return (f"first differs at token {pos}: HF picks {theirs[pos]} (logit {logits[theirs[pos]].item():.4f}), "
            f"surge {ours[pos]} (HF logit {ours_logit:.4f}, gap {logits[theirs[pos]].item() - ours_logit:.4f}); "
            f"HF's own top-2 gap {(top2.values[0] - top2.values[1]).item():.4f}, logit scale (std) "
            f"{logits.std().item():.3f}")


def run_parity(args: argparse.Namespace) -> int:
    engine = build_engine(args)
    mc = engine.config.model_config
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, 0.0, mc.vocab_size,
                             args.workload_seed, args.input_len_max)
    hf = hf_model_for(engine)  # the engine takes HF's weights: the same model
    ours = run_engine(engine, workload, show_progress=False)
    prompts = [p for p, _ in workload]
    theirs = _hf_greedy(hf, prompts, args.output_len)
    same = 0
    for i, prompt in enumerate(prompts):
        pos = first_divergence(ours[str(i)], theirs[i])
        if pos is None:
            same += 1
            print(f"prompt {i} ({len(prompt)} tokens): identical for {args.output_len} tokens", flush=True)
        else:
            print(f"prompt {i} ({len(prompt)} tokens): {_divergence_report(hf, prompt, ours[str(i)], theirs[i], pos)}",
                  flush=True)
    print(f"greedy outputs identical to HF generate ({mc.dtype}): {same}/{len(prompts)}", flush=True)
    if args.fp32_reference and mc.dtype != torch.float32:
        ref = copy.deepcopy(hf).float()
        ours_ok = sum(_agrees_with(ref, p, ours[str(i)]) for i, p in enumerate(prompts))
        hf_ok = sum(_agrees_with(ref, p, t) for p, t in zip(prompts, theirs))
        total = sum(len(t) for t in theirs)
        print(f"float32 reference on the same weights: surge's greedy token is its argmax at {ours_ok}/{total} "
              f"positions, HF {mc.dtype}'s at {hf_ok}/{total}", flush=True)
        del ref
    if args.hf_self_check:
        hf.set_attn_implementation("eager")
        eager = _hf_greedy(hf, prompts, args.output_len)
        agree = sum(e == t for e, t in zip(eager, theirs))
        where = [first_divergence(e, t) for e, t in zip(eager, theirs)]
        print(f"noise floor: HF eager attention identical to HF default attention: {agree}/{len(prompts)} "
              f"(first differences at {where})", flush=True)
    return 0 if same == len(prompts) else 1
