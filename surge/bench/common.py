"""Shared benchmark plumbing: build the engine (model directory or random-weight preset), random-token workloads,
a tokenizer-free driver for EngineCore, and the HF transformers peers run on the same weights."""
from __future__ import annotations

import argparse
import dataclasses
import time
import types
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from surge.engine.args import EngineArgs
from surge.engine.core import EngineCore
from surge.core.request import Request
from surge.lora_request import LoRARequest
from surge.sampling_params import SamplingParams


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help="random-weight model from a built-in config: qwen3-8b, "
                   "qwen3-30b-a3b, llama3.1-8b, tiny-llama, tiny-qwen3-hybrid, tiny-qwen3-moe (instead of --model)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--warmup-workers", type=int, default=1, help="kernel warm-up compile threads (1: serial)")


@dataclass(frozen=True)
class ActiveWeights:
    """What a step reads and computes of a model's weights. Dense: everything, every step. Mixture of experts: the
    weights outside the experts, plus per MoE layer the experts the step's tokens were routed to."""
    params: int  # every parameter
    nbytes: int
    expert_params: int  # the experts' (stacked gate|up and down), all layers
    expert_bytes: int
    num_experts: int  # per MoE layer (0: dense)
    top_k: int

    @staticmethod
    def of(model: torch.nn.Module) -> ActiveWeights:
        from surge.model.layers.moe import FusedMoE

        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), FusedMoE)]  # their top_k
        ps = [p for m in experts for p in m.parameters()]
        return ActiveWeights(params=sum(p.numel() for p in model.parameters()),
                             nbytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                             expert_params=sum(p.numel() for p in ps),
                             expert_bytes=sum(p.numel() * p.element_size() for p in ps),
                             num_experts=experts[0].num_experts if experts else 0,
                             top_k=blocks[0].top_k if blocks else 0)

    def experts_touched(self, num_tokens: int) -> float:
        """Experts of a layer that num_tokens tokens reach: exactly top_k for one token; for more, the expectation
        under uniform routing, E * (1 - (1 - k / E) ** T)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)

    def step_bytes(self, num_tokens: int) -> float:
        """Weight bytes one forward over num_tokens tokens reads."""
        if not self.num_experts:
            return float(self.nbytes)
        share = self.experts_touched(num_tokens) / self.num_experts
        return self.nbytes - self.expert_bytes + share * self.expert_bytes

    @property
    def params_per_token(self) -> float:
        """Parameters each token multiplies by (for FLOPs): all but the experts, and top_k experts per layer."""
        if not self.num_experts:
            return float(self.params)
        return self.params - self.expert_params + self.top_k / self.num_experts * self.expert_params


def make_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int, input_len_max: int | None = None,
                  output_len_max: int | None = None) -> list[tuple[list[int], int]]:
    """Random-token prompts. Lengths: fixed, uniform in len x [1 - r, 1 + r], or uniform in [len, len_max]."""
    for name, value in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio={range_ratio} must be in [0, 1)")
    g = torch.Generator().manual_seed(seed)

    def length(mean: int, maximum: int | None) -> int:
        lo, hi = (mean, maximum) if maximum else (max(1, int(mean * (1 - range_ratio))), int(mean * (1 + range_ratio)))
        if hi < lo:
            raise ValueError(f"length range [{lo}, {hi}] is empty")
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    low = min(100, vocab_size // 2)  # avoid the low ids, which are usually special tokens
    return [(torch.randint(low, vocab_size, (length(input_len, input_len_max),), generator=g).tolist(),
             length(output_len, output_len_max)) for _ in range(num_prompts)]


def parse_image_size(text: str, flag: str = "--image-size") -> tuple[int, int]:
    """'WIDTHxHEIGHT' -> (width, height), each >= 1."""
    width, sep, height = text.lower().partition("x")
    if not (sep and width.isdigit() and height.isdigit() and int(width) >= 1 and int(height) >= 1):
        raise ValueError(f"{flag}={text!r} must be WIDTHxHEIGHT, e.g. 1024x1024")
    return int(width), int(height)


def random_image(size: tuple[int, int], seed: int):
    """A PIL image of uniform random pixels: distinct per seed, so no two share the encoder or prefix cache."""
    import numpy as np
    from PIL import Image
    width, height = size
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def build_engine(args: argparse.Namespace) -> EngineCore:
    """The engine of the engine flags and add_model_args's (--preset, --enforce-eager, --warmup-workers)."""
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.preset:
        if engine_args.model:
            raise ValueError("give --model or --preset, not both")
        engine_args = dataclasses.replace(engine_args, load_format="dummy")
    start = time.perf_counter()
    engine = EngineCore(engine_args.create_engine_config())
    engine.startup_seconds = time.perf_counter() - start
    runner = getattr(engine.executor, "runner", None)  # the in-process runner's phases (tp == 1) only
    graph_runner = runner.graph_runner if runner is not None else None
    background = ""
    if graph_runner is not None and graph_runner.capturing:  # a benchmark measures the engine with all its graphs
        start = time.perf_counter()
        graph_runner.wait()
        background = (f"; {graph_runner.background_seconds:.2f} s more in the background, waited "
                      f"{time.perf_counter() - start:.2f} s for it")
    graphs = graph_runner.capture_seconds if graph_runner is not None else 0.0
    warmup = runner.warmup_seconds if runner is not None else 0.0
    print(f"start-up: {engine.startup_seconds:.2f} s to ready (kernel warm-up {warmup:.2f} s with "
          f"{args.warmup_workers} worker(s), CUDA graph capture {graphs:.2f} s{background})", flush=True)
    return engine


def run_engine(engine: EngineCore, workload: list[tuple[list[int], int]], desc: str = "surge",
               show_progress: bool = True, loras: list[LoRARequest | None] | None = None) -> dict[str, list[int]]:
    """Greedy, exactly the requested number of tokens per prompt (loras: each one's adapter); returns request id ->
    output token ids."""
    cfg = engine.config
    for i, (prompt, out_len) in enumerate(workload):
        params = SamplingParams(temperature=0, max_tokens=out_len, min_tokens=out_len, ignore_eos=True)
        engine.add_request(Request(str(i), prompt, params, cfg.cache_config.block_size,
                                   lora_request=None if loras is None else loras[i]))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(workload))}
    bar = tqdm(total=len(workload), desc=desc, unit="req", disable=not show_progress)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                bar.update(1)
    bar.close()
    return outputs


def hf_model_for(engine: EngineCore):
    """The HF transformers model with the same config; the engine then takes its weights, so both are identical."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from surge.model.loader.safetensors_loader import load_weights

    mc = engine.config.model_config
    if mc.load_format == "dummy":
        cfg = dict(mc.hf_config)
        hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        torch.manual_seed(engine.config.seed)
        with torch.device(engine.config.device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=mc.dtype)
        load_weights(engine.executor.model, model.state_dict().items(), "HF model")
    else:
        model = AutoModelForCausalLM.from_pretrained(mc.model, dtype=mc.dtype).to(engine.config.device)
    return model.eval()


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a timed region's edges); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()


# Where the engine loop's thread spends a step (HostTimer); "rest" is what none of the others covers.
HOST_PHASES = ("device wait", "schedule", "outputs", "propose", "prepare", "launch", "verify", "advance", "fill",
               "upload", "apply", "rest")


class HostTimer:
    """Where the engine loop's thread spends a step: waiting for the device (a step's result), scheduling, processing
    outputs, looking up speculative drafts; the in-process runner preparing the step's inputs, launching its
    forward (a graph replay or eager launches) and its drafts' verification; and the grammar's work on this thread
    (advancing the matchers; filling masks, or waiting for the fill when it runs behind the outputs; uploading
    them; applying them: on a GPU, launching the kernels). The rest is everything else (sampling's launches, the
    executor). Phases the engine does not have (an older one) stay at zero."""

    def __init__(self, engine: EngineCore) -> None:
        from surge.worker import executor, model_runner

        self.seconds = dict.fromkeys(("step", *HOST_PHASES[:-1], "propose in outputs"), 0.0)
        self.steps = self.waits = 0
        self._undo = []
        manager = engine.structured_output
        self._wrap(engine, "step", "step", count=True)
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine, "_process", "outputs")
        self._wrap(engine, "_propose", "propose in outputs")  # taken out of "outputs" in per_step
        self._wrap(manager, "advance", "advance")
        self._wrap(manager, "bitmask", "fill")
        self._wrap(manager, "fill_in_background", "fill", returns_wait=True)
        self._wrap(model_runner, "_apply_grammar", "upload")  # less the apply inside it, in per_step
        self._wrap(model_runner, "apply_token_bitmask_", "apply")
        self._wrap(model_runner.PendingOutput, "result", "device wait")
        # The in-process runner's own parts of a step (zero for worker ranks in other processes).
        self._wrap(model_runner.ModelRunner, "prepare_inputs", "prepare")
        self._wrap(model_runner.ModelRunner, "forward", "launch")  # a graph replay, or the eager launches
        self._wrap(model_runner.ModelRunner, "_verify_drafts", "verify")
        self._wrap(model_runner.ModelRunner, "_propose_ngram", "propose")  # the device lookup's launches
        if hasattr(executor, "_RemoteStep"):
            self._wrap(executor._RemoteStep, "result", "device wait")
        waits_for = manager.waits_for

        def counted(*a):
            waited = waits_for(*a)
            self.waits += waited
            return waited
        self._set(manager, "waits_for", counted)

    def _set(self, owner, name: str, value) -> None:
        shared = isinstance(owner, (type, types.ModuleType))  # else an instance: its own attribute hides the class's
        self._undo.append((owner, name, getattr(owner, name) if shared else None, shared))
        setattr(owner, name, value)

    def _wrap(self, owner, name: str, key: str, count: bool = False, returns_wait: bool = False) -> None:
        if not hasattr(owner, name):
            return
        inner, seconds = getattr(owner, name), self.seconds

        def timed(*a):
            start = time.perf_counter()
            result = inner(*a)
            seconds[key] += time.perf_counter() - start
            self.steps += count
            if returns_wait:  # the fill's wait, later on this thread
                return lambda: self._timed_call(result, key)
            return result
        self._set(owner, name, timed)

    def _timed_call(self, fn, key: str):
        start = time.perf_counter()
        result = fn()
        self.seconds[key] += time.perf_counter() - start
        return result

    def restore(self) -> None:
        for owner, name, original, shared in reversed(self._undo):
            if shared:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

    def per_step(self) -> dict[str, float]:
        """Seconds per step of each phase, and "rest" (the step's time in none of them)."""
        n = max(self.steps, 1)
        out = {k: v / n for k, v in self.seconds.items()}
        out["upload"] -= out["apply"]
        inside = out.pop("propose in outputs")
        out["outputs"] -= inside
        out["propose"] += inside
        out["rest"] = out["step"] - sum(out[k] for k in HOST_PHASES[:-1])
        return out
