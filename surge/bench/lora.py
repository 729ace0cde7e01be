"""LoRA in the offline benchmarks: `surge bench throughput|latency --num-lora-adapters N --lora-rank R`.

N random PEFT adapters (rank R on the 7 attention and MLP projections of every layer, lora_alpha = 2R, A ~
randn / sqrt(fan_in), B ~ 0.01 randn, so outputs do change) are written for the model's shapes into a temporary
directory, generated on the engine's device in its dtype (seconds at 8B); the engine starts with enable_lora
(max_loras N and max_lora_rank R unless --max-loras / --max-lora-rank say otherwise), and each workload runs
round-robin over the adapters and without them, in that same engine, so the ratio compares like with like. The
adapters, the warm-up (every adapter loaded first) and the workloads are those of
shared/tools/vllm-peer/peer_breadth.py `lora`, so vLLM's figures stand beside these.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from surge.lora_request import LoRARequest

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def add_lora_bench_args(p: argparse.ArgumentParser) -> None:
    """After EngineArgs.add_cli_args(p): its --max-loras and --max-lora-rank then default to the adapters'."""
    g = p.add_argument_group("LoRA")
    g.add_argument("--num-lora-adapters", type=int, default=0, help="write this many random PEFT adapters and run "
                   "the workload round-robin over them and without them, in one engine, and print the ratio")
    g.add_argument("--lora-rank", type=int, default=16, help="the random adapters' rank")
    p.set_defaults(max_loras=None, max_lora_rank=None)


def resolve_lora_args(args: argparse.Namespace) -> None:
    """The engine flags the adapters need: enable_lora, max_loras (default N), max_lora_rank (default R)."""
    from surge.engine.args import EngineArgs

    n = getattr(args, "num_lora_adapters", 0)
    defaults = EngineArgs()
    if n < 0:
        raise ValueError(f"--num-lora-adapters={n} must be >= 0")
    if n and args.lora_rank < 1:
        raise ValueError(f"--lora-rank={args.lora_rank} must be >= 1")
    if n:
        args.enable_lora = True
    if getattr(args, "max_loras", 1) is None:
        args.max_loras = n or defaults.max_loras
    if getattr(args, "max_lora_rank", 1) is None:
        args.max_lora_rank = args.lora_rank if n else defaults.max_lora_rank


def projection_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """Checkpoint module (under model.layers.N) -> (fan_in, fan_out) of a dense decoder layer."""
    h = hf_config["hidden_size"]
    hd = hf_config.get("head_dim") or h // hf_config["num_attention_heads"]
    q = hf_config["num_attention_heads"] * hd
    kv = hf_config.get("num_key_value_heads", hf_config["num_attention_heads"]) * hd
    inter = hf_config["intermediate_size"]
    fans = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    return dict(zip(PROJECTIONS, fans))


def write_adapter(path: Path, hf_config: dict, rank: int, seed: int, device: torch.device,
                  dtype: torch.dtype) -> int:
    """One random adapter in PEFT's files; returns its weights' bytes."""
    from safetensors.torch import save_file

    g = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for i in range(hf_config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in projection_shapes(hf_config).items():
            prefix = f"base_model.model.model.layers.{i}.{name}"
            a = torch.randn(rank, fan_in, generator=g, device=device, dtype=dtype).mul_(fan_in ** -0.5)
            b = torch.randn(fan_out, rank, generator=g, device=device, dtype=dtype).mul_(0.01)
            tensors[prefix + ".lora_A.weight"], tensors[prefix + ".lora_B.weight"] = a.cpu(), b.cpu()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    targets = [name.rsplit(".", 1)[1] for name in PROJECTIONS]
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "target_modules": targets, "modules_to_save": None,
        "use_rslora": False, "use_dora": False}))
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class LoRABench:
    """The benchmark's adapters: their requests, one adapter's bytes (what a step reads per distinct adapter in
    it), and the directory they live in (removed with this object)."""
    requests: list[LoRARequest]
    rank: int
    adapter_bytes: int
    write_seconds: float
    directory: tempfile.TemporaryDirectory = field(repr=False)

    def round_robin(self, n: int) -> list[LoRARequest]:
        """Request i's adapter: i mod N (so a batch of one runs one adapter)."""
        return [self.requests[i % len(self.requests)] for i in range(n)]

    def distinct(self, n: int) -> int:
        """Adapters in a batch of n round-robin requests."""
        return min(n, len(self.requests))

    def describe(self) -> str:
        return (f"{len(self.requests)} random rank-{self.rank} LoRA adapters on q/k/v/o/gate/up/down, "
                f"{self.adapter_bytes / 1e6:.1f} MB each, written in {self.write_seconds:.1f} s")


def make_lora_bench(engine, args: argparse.Namespace) -> LoRABench | None:
    """Write the adapters for the engine's model and check the first against it (a model they do not fit is
    refused here, by name, not as a failed step); None without --num-lora-adapters."""
    from surge.lora.checker import AdapterChecker

    n = getattr(args, "num_lora_adapters", 0)
    if not n:
        return None
    mc = engine.config.model_config
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
               if not isinstance(mc.hf_config.get(k), int)]
    if missing:
        raise ValueError(f"--num-lora-adapters writes adapters for a dense decoder's 7 projections; this model's "
                         f"config has no {', '.join(missing)}")
    device = engine.config.device
    directory = tempfile.TemporaryDirectory(prefix="surge-bench-loras-")
    start = time.perf_counter()
    requests, nbytes = [], 0
    for k in range(n):
        path = Path(directory.name) / f"adapter{k}"
        nbytes = write_adapter(path, mc.hf_config, args.lora_rank, 100 + k, device, mc.dtype)
        requests.append(LoRARequest(f"adapter{k}", k + 1, str(path)))
    bench = LoRABench(requests, args.lora_rank, nbytes, time.perf_counter() - start, directory)
    AdapterChecker(engine.config).check(requests[0])
    return bench


def warm_up_adapters(engine, bench: LoRABench, vocab_size: int) -> float:
    """peer_breadth's warm-up: a short request per adapter (each loaded into its slot), then two without."""
    from surge.bench.common import make_workload, run_engine

    start = time.perf_counter()
    n = len(bench.requests)
    run_engine(engine, make_workload(n, 8, 2, 0.0, vocab_size, 1), show_progress=False, loras=bench.round_robin(n))
    run_engine(engine, make_workload(2, 8, 2, 0.0, vocab_size, 1), show_progress=False)
    return time.perf_counter() - start
