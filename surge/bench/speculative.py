"""`surge bench latency --speculative-config JSON`: one workload run with and without speculation in the same
process: tok/s of each, the speed-up, acceptance rate, mean accepted length and acceptance per draft position; greedy
outputs compared. `--workload quote`: chat prompts that hand the model a passage and ask it to repeat or rewrite it
(the real model's tokenizer and chat template). `--verify-cost`: one verification step of k drafts against one
decode step, per batch size (drafts forced on every step, so every step verifies k)."""
from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

from surge.bench.common import HostTimer, build_engine, make_workload, run_engine, sync_device
from surge.core.spec_decode_stats import SpecDecodingStats
from surge.engine.core import EngineCore
from surge.engine.input_processor import load_tokenizer

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
    "great lens until it shone, and wrote the weather in a leather book: wind from the west, a heavy swell, two "
    "fishing boats home before dark. In forty years he had missed only one night, when the storm took the roof off "
    "the cottage and he carried his lamp up the tower by hand.",
    "To make bread, mix flour, water, salt and a little yeast into a rough dough. Leave it covered for an hour, "
    "then fold it over itself a few times so the gluten grows strong. Shape it into a round loaf, let it rise "
    "again until it has nearly doubled, and bake it in a very hot oven until the crust is deep brown and the loaf "
    "sounds hollow when you tap the bottom.",
    "The committee met on Tuesday to review the budget for the new library. The architect presented three designs: "
    "a glass reading room facing the river, a brick building that matches the old town hall, and a smaller plan "
    "that keeps the existing walls. After a long discussion the members agreed to ask the public for comments "
    "before the next meeting in March.",
]
INSTRUCTIONS = [
    "Repeat the passage above word for word.",
    "Rewrite the passage above exactly as it is written, sentence by sentence.",
    "Copy the passage above, then stop.",
]


def add_speculative_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--workload", choices=["random", "quote"], default="random",
                   help="quote: prompts that quote a passage and ask to repeat or rewrite it (needs a tokenizer)")
    g.add_argument("--verify-cost", action="store_true", help="with --speculative-config: time a step that "
                   "verifies k drafts per request against a decode step, per batch size")


def quote_workload(engine: EngineCore, num_prompts: int, output_len: int) -> list[tuple[list[int], int]]:
    tokenizer = load_tokenizer(engine.config.model_config.model)
    out = []
    for i in range(num_prompts):
        text = f"{PASSAGES[i % len(PASSAGES)]}\n\n{INSTRUCTIONS[(i // len(PASSAGES)) % len(INSTRUCTIONS)]}"
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text + "\n\n")["input_ids"]
        out.append((list(ids), output_len))
    return out


def _workload(args: argparse.Namespace, engine: EngineCore, bs: int) -> list[tuple[list[int], int]]:
    if args.workload == "quote":
        return quote_workload(engine, bs, args.output_len)
    return make_workload(bs, args.input_len, args.output_len, 0.0, engine.config.model_config.vocab_size, bs)


def _timed_run(engine: EngineCore, workload, repeats: int) -> tuple[float, dict[str, list[int]]]:
    best, outputs = float("inf"), {}
    for _ in range(repeats):
        engine.kv_cache_manager.reset_prefix_cache()
        sync_device(engine.config.device)
        start = time.perf_counter()
        outputs = run_engine(engine, workload, show_progress=False)
        sync_device(engine.config.device)
        best = min(best, time.perf_counter() - start)
    return best, outputs


def _delta(after: SpecDecodingStats, before: SpecDecodingStats) -> SpecDecodingStats:
    per_pos = [a - (before.accepted_per_pos[j] if j < len(before.accepted_per_pos) else 0)
               for j, a in enumerate(after.accepted_per_pos)]
    return SpecDecodingStats(after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
                             after.num_accepted_tokens - before.num_accepted_tokens, per_pos)


def _copy(stats: SpecDecodingStats) -> SpecDecodingStats:
    return SpecDecodingStats(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                             list(stats.accepted_per_pos))


def run_speculative_latency(args: argparse.Namespace) -> None:
    values = vars(args)
    if values.get("kv_cache_memory") is None and values.get("num_gpu_blocks_override") is None:
        # Two engines in one process: the first must leave the second its share of the free memory.
        values = {**values, "memory_fraction": values.get("memory_fraction", 0.9) / 2}
    plain = build_engine(argparse.Namespace(**{**values, "speculative_config": None}))
    spec = build_engine(argparse.Namespace(**values))
    sc = spec.config.speculative_config
    print(f"speculative decoding: {sc.method}, k={sc.num_speculative_tokens}; workload {args.workload}; "
          f"device {spec.config.device}", flush=True)
    for engine in (plain, spec):  # warm-up
        run_engine(engine, _workload(args, engine, 1)[:1], show_progress=False)
    if args.verify_cost:
        return _verify_cost(args, plain, spec)
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        workload = _workload(args, plain, bs)
        tokens = sum(n for _, n in workload)
        before = _copy(spec.scheduler.spec_stats)
        draft_before = Counter(_draft_counts(spec))
        t_plain = t_spec = float("inf")
        for _ in range(args.repeats):  # in turn, so a load that comes and goes hits both alike
            t, out_plain = _timed_run(plain, workload, 1)
            t_plain = min(t_plain, t)
            t, out_spec = _timed_run(spec, workload, 1)
            t_spec = min(t_spec, t)
        d = _delta(spec.scheduler.spec_stats, before)
        per_pos = ", ".join(f"{a / d.num_drafts:.2f}" for a in d.accepted_per_pos) if d.num_drafts else "-"
        print(f"batch {bs:4d}, prompts of {sum(len(p) for p, _ in workload) // bs} tokens, {args.output_len} out: "
              f"without {tokens / t_plain:8.1f} tok/s, with {tokens / t_spec:8.1f} tok/s, speed-up "
              f"{t_plain / t_spec:.2f}x | acceptance rate {d.acceptance_rate:.1%}, mean accepted length "
              f"{d.mean_accepted_length:.2f} (per position {per_pos}); greedy identical: {out_plain == out_spec}",
              flush=True)
        if _draft_counts(spec) is not None:
            print(_draft_line(_draft_counts(spec) - draft_before), flush=True)


def _draft_counts(engine: EngineCore) -> Counter | None:
    """The draft model's forward and wait counters (surge/worker/draft_model.py), where its runner is in-process."""
    draft = getattr(getattr(engine.executor, "runner", None), "draft", None)
    return None if draft is None else draft.counts


def _draft_line(c: Counter) -> str:
    """Per step of the draft: its forward over the step's tokens and its k decode passes, by graph or eager, and
    the host's waits for the device (none on a GPU; on the CPU, a read of where the proposals start)."""
    n = max(c["steps"], 1)
    return (f"draft model per step ({c['steps']} steps): step forward {c['step graph'] / n:.2f} graph + "
            f"{c['step eager'] / n:.2f} eager, decode passes {c['pass graph'] / n:.2f} graph + "
            f"{c['pass eager'] / n:.2f} eager, host waits {c['host waits'] / n:.2f}")


class _AlwaysPropose:
    """Proposes k copies of the last token on every step: most are rejected, so every step verifies k."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        k = self.k if max_tokens is None else max(0, min(self.k, max_tokens))
        return [token_ids[-1]] * k


def _always_propose_on_device(ngram) -> None:
    """The device lookup (surge/worker/ngram_lookup.py) made to answer k copies of each row's newest token, all of
    them to verify: the lookup still runs, so the step pays for it as a real one does."""
    step = ngram.step

    def forced(rows, sampled, verdicts):
        tokens, rejected, valid = step(rows, sampled, verdicts)
        return tokens[:, :1].expand_as(tokens).contiguous(), rejected, torch.full_like(valid, ngram.k)

    ngram.step = forced


def _per_step(engine: EngineCore, workload, repeats: int) -> tuple[float, dict[str, float]]:
    """Seconds per step after the prefill: (whole run - prompt-only run) / the decode steps between; and where the
    engine loop's thread spent a step of the last whole run (HostTimer's phases)."""
    counter = {"steps": 0}
    inner = engine.scheduler.schedule

    def counted():
        out = inner()
        counter["steps"] += bool(out.scheduled)
        return out

    engine.scheduler.schedule = counted
    try:
        prefill, _ = _timed_run(engine, [(p, 1) for p, _ in workload], repeats)
        counter["steps"] = 0
        _timed_run(engine, [(p, 1) for p, _ in workload], 1)
        prefill_steps = counter["steps"]
        counter["steps"] = 0
        timer = HostTimer(engine)
        try:
            total, _ = _timed_run(engine, workload, repeats)
        finally:
            timer.restore()
        steps = counter["steps"] / repeats - prefill_steps
    finally:
        engine.scheduler.schedule = inner
    return (total - prefill) / max(steps, 1), timer.per_step()


def _verify_cost(args: argparse.Namespace, plain: EngineCore, spec: EngineCore) -> None:
    """A verification step of k forced drafts against a decode step, and the decode step without async scheduling
    (the difference between the two decode figures is the host's share that async scheduling hides; n-gram
    verification steps overlap like decode steps there, their drafts looked up on the device), each with the engine
    loop's host time per step by phase."""
    k = spec.config.speculative_config.num_speculative_tokens
    runner = getattr(spec.executor, "runner", None)
    if spec.proposer is not None:
        spec.proposer = _AlwaysPropose(k)
    elif runner is not None and runner.ngram is not None:  # async scheduling: drafts looked up on the device
        _always_propose_on_device(runner.ngram)
    else:
        raise ValueError("--verify-cost forces drafts through the n-gram proposer's place: use method 'ngram' (and "
                         "one rank in the engine's process, under async scheduling)")
    phases = ("step", "device wait", "schedule", "outputs", "propose", "prepare", "launch", "verify", "rest")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        workload = make_workload(bs, args.input_len, args.output_len, 0.0, plain.config.model_config.vocab_size, bs)
        decode, decode_host = _per_step(plain, workload, args.repeats)
        rows = [("decode", decode, decode_host)]
        if plain.async_scheduling:
            plain.async_scheduling = False
            try:
                rows.append(("decode, sync", *_per_step(plain, workload, args.repeats)))
            finally:
                plain.async_scheduling = True
        verify, verify_host = _per_step(spec, workload, args.repeats)
        rows.append((f"verify k={k}", verify, verify_host))
        print(f"batch {bs:4d}, context {args.input_len}..{args.input_len + args.output_len}: decode step "
              f"{decode * 1e3:8.3f} ms, verification step of k={k} ({bs * (k + 1)} tokens) {verify * 1e3:8.3f} ms: "
              f"{verify / decode:.2f}x a decode step", flush=True)
        print(f"  {'host ms per step':<16}{'step time':>11}" + "".join(f"{p:>13}" for p in phases))
        for name, seconds, host in rows:
            print(f"  {name:<16}{seconds * 1e3:11.3f}" + "".join(f"{host[p] * 1e3:13.3f}" for p in phases),
                  flush=True)
