"""`surge bench structured`: the cost of grammar masks. One engine, one batch of random-token prompts, decoded twice
in the same run: unconstrained, then with every request under one JSON schema; per-output-token time of each, their
ratio, and where the engine loop's thread spends a step in each (waiting for the device, scheduling, outputs, and the
grammar's work: advancing the matchers, filling the masks, uploading and applying them).

The schema has more required fields than the output has tokens, so no request can finish its grammar (or be ended
by EOS) early: both runs decode exactly --output-len tokens per request at a constant batch.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from surge.bench.common import HOST_PHASES, HostTimer, add_model_args, make_workload, sync_device
from surge.core.request import Request
from surge.engine.args import EngineArgs
from surge.engine.core import EngineCore
from surge.sampling_params import SamplingParams, StructuredOutputsParams

_NUM_FIELDS = 128  # > output_len / 2 for the default 256: the object cannot be closed within the output


def bench_schema(num_fields: int = _NUM_FIELDS) -> dict:
    """An object of num_fields required fields cycling through bounded strings, enums, integers, arrays and nested
    objects: the mask is computed in every kind of lexer and parser state, never in a trivially long string."""
    kinds = [{"type": "string", "maxLength": 8}, {"enum": ["red", "green", "blue", "cyan"]},
             {"type": "integer", "minimum": 0, "maximum": 9999},
             {"type": "array", "items": {"type": "number"}, "maxItems": 3},
             {"type": "object", "properties": {"ok": {"type": "boolean"}, "id": {"type": "integer"}},
              "required": ["ok", "id"], "additionalProperties": False}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(num_fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def add_structured_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=256)
    g.add_argument("--repeats", type=int, default=2, help="timed runs per case (the best is reported)")
    g.add_argument("--tokenizer", default=None, help="HF tokenizer directory the grammar is compiled against "
                   "(default: the model's; for a preset, which has none, the default model's, its ids padded to the "
                   "preset's vocabulary)")


def _run(engine: EngineCore, workload, params: SamplingParams) -> tuple[float, dict[str, int], HostTimer]:
    block = engine.config.cache_config.block_size
    for i, (prompt, out_len) in enumerate(workload):
        # Exactly out_len tokens: EOS ignored (under the schema it cannot come before the schema is complete, and
        # the schema is longer than any run; min_tokens cannot hold a grammar's end).
        p = params.clone(max_tokens=out_len, ignore_eos=True, _eos_token_ids=engine.config.model_config.eos_token_ids)
        engine.add_request(Request(str(i), prompt, p, block))
    counts = {str(i): 0 for i in range(len(workload))}
    sync_device(engine.config.device)
    timer = HostTimer(engine)
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                counts[o.request_id] += len(o.new_token_ids)
        sync_device(engine.config.device)
    finally:
        timer.restore()
    return time.perf_counter() - start, counts, timer


def _tpot(engine: EngineCore, workload, params: SamplingParams, repeats: int) -> tuple[float, HostTimer]:
    """(decode of output_len tokens - the prefill alone) / (output_len - 1), each the best of `repeats`; and the
    host breakdown of the best full run."""
    out_len = workload[0][1]
    best = {}
    for n in (1, out_len):
        for _ in range(repeats):
            engine.kv_cache_manager.reset_prefix_cache()
            seconds, counts, timer = _run(engine, [(p, n) for p, _ in workload], params)
            assert all(c == n for c in counts.values()), f"outputs of {sorted(set(counts.values()))} tokens, not {n}"
            if n not in best or seconds < best[n][0]:
                best[n] = (seconds, timer)
    return (best[out_len][0] - best[1][0]) / max(out_len - 1, 1), best[out_len][1]


def _engine(args: argparse.Namespace) -> EngineCore:
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.preset:
        engine_args = dataclasses.replace(engine_args, load_format="dummy")
    config = engine_args.create_engine_config()
    tokenizer = args.tokenizer
    if tokenizer is None and engine_args.preset:
        from surge.model.loader.default_model import default_model_path
        tokenizer = str(default_model_path())
    config = dataclasses.replace(config, structured_outputs_config=dataclasses.replace(
        config.structured_outputs_config, tokenizer=tokenizer))
    return EngineCore(config)


def run_structured(args: argparse.Namespace) -> None:
    if args.output_len < 2 or args.output_len >= 2 * _NUM_FIELDS:
        raise ValueError(f"output_len={args.output_len} must be in [2, {2 * _NUM_FIELDS}) so that no request can "
                         "complete the benchmark's schema early")
    engine = _engine(args)
    mc = engine.config.model_config
    so = engine.config.structured_outputs_config
    workload = make_workload(args.batch_size, args.input_len, args.output_len, 0.0, mc.vocab_size, 0)
    plain = SamplingParams(temperature=0, ignore_eos=True)
    constrained = plain.clone(structured_outputs=StructuredOutputsParams(json=bench_schema()))
    _run(engine, make_workload(2, 16, 4, 0, mc.vocab_size, 1), constrained)  # warm-up, and the tokenizer bridge
    vocab = engine.structured_output.tokenizer.vocab_size
    print(f"model {mc.model} ({mc.dtype}, {engine.config.device}), grammar tokenizer {so.tokenizer or mc.model} "
          f"({vocab} ids, masks of {engine.structured_output.num_words} words), "
          f"{'async' if engine.async_scheduling else 'sync'} scheduling; batch {args.batch_size}, in "
          f"{args.input_len}, out {args.output_len}, JSON schema of {_NUM_FIELDS} required fields", flush=True)
    base, plain_timer = _tpot(engine, workload, plain, args.repeats)
    masked, timer = _tpot(engine, workload, constrained, args.repeats)
    print(f"unconstrained: {base * 1e3:8.3f} ms per output token step ({args.batch_size / base:9.1f} tok/s)\n"
          f"JSON schema:   {masked * 1e3:8.3f} ms per output token step ({args.batch_size / masked:9.1f} tok/s); "
          f"{timer.waits} of {timer.steps} steps waited for the token in flight\n"
          f"ratio {masked / base:.3f}x (target <= 1.05x)", flush=True)
    print("host per engine step, ms (best run of each; the loop's thread: 'step' less 'device wait' is its work)")
    print(f"{'':15}" + "".join(f"{k:>14}" for k in ("step", *HOST_PHASES)))
    for name, t in (("unconstrained", plain_timer), ("JSON schema", timer)):
        phases = t.per_step()
        print(f"{name:15}" + "".join(f"{phases[k] * 1e3:14.3f}" for k in ("step", *HOST_PHASES)), flush=True)
