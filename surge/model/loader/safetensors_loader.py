"""Fill a built model: from an HF-format checkpoint (one or many safetensors shards) through each parameter's
weight loader, from any (name, tensor) iterator (an HF model in memory), or with random weights.

Building the model and choosing how to fill it is base.py's (the load_format table)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from surge.model.layers.gemm import drop_packed_weights
from surge.model.layers.linear import default_weight_loader


def safetensors_files(model_dir: str | Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


def iterate_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(model_dir)
    if not files:
        raise ValueError(f"model={str(model_dir)!r}: no *.safetensors weight files found")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_tensor_names(model_dir: str | Path) -> tuple[str, ...]:
    """The names of a checkpoint's tensors, from its safetensors headers, read once per process while the files
    stay as they are: an engine builds its model several times (on the meta device for the KV cache layout, LoRA
    checks and the weight cache, then to load), and each build asks which checkpoint tensors its layers load."""
    files = safetensors_files(model_dir)
    return _tensor_names(tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files))


@lru_cache(maxsize=4)
def _tensor_names(files: tuple[tuple[str, int, int], ...]) -> tuple[str, ...]:
    names: list[str] = []
    for file, _, _ in files:
        with safe_open(file, framework="pt") as f:
            names.extend(f.keys())
    return tuple(names)


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Every parameter must receive a tensor; checkpoint tensors that match no parameter are an error. Buffers with a
    weight loader (an attention layer's KV cache scales) are filled when the checkpoint has them."""
    params = dict(model.named_parameters())
    required = set(params)
    params.update((name, b) for name, b in model.named_buffers() if hasattr(b, "weight_loader"))
    loaded: set[str] = set()
    skip = tuple("." + s for s in getattr(model, "quant_skip", ()))  # what a quantization's layers do not read
    for name, tensor in weights:
        target = model.checkpoint_name_to_param(name)
        if target is None or (skip and name.endswith(skip)):
            continue
        param_name, shard_id = target
        if param_name not in params:
            hint = ""
            if name.rsplit(".", 1)[-1] not in ("weight", "bias"):
                hint = (" (a quantization tensor: the checkpoint quantizes a layer Surge keeps unquantized, or its "
                        "config.json lacks the quantization_config that describes it)")
            raise ValueError(f"{source}: checkpoint tensor {name!r} matches no parameter of "
                             f"{type(model).__name__}{hint}")
        param = params[param_name]
        # Loaders copy (converting dtype and device) only this rank's slice: the full tensor stays where it was read.
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                default_weight_loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"{source}: tensor {name!r}: {e}") from None
        loaded.add(param_name)
    drop_packed_weights(model)  # the CPU GEMM's packed copies predate these values
    missing = sorted(name for name in required - loaded  # a parameter another one's loader writes is not missing
                     if f"{name.rsplit('.', 1)[0]}.{getattr(params[name], 'loaded_with', None)}" not in loaded)
    if missing:
        raise ValueError(f"{source}: checkpoint lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: small normal values, norms near 1, so activations stay finite."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    quantized = set()
    for module_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and method.name != "unquantized":  # its own storage (fp8, packed int ...)
            method.init_dummy(module, gen)
            quantized.update(f"{module_name}.{p}" for p, _ in module.named_parameters(recurse=False)
                             if not p.endswith("bias"))
    for name, param in model.named_parameters():
        if name in quantized:
            continue
        if "norm" in name:  # a norm's scale 1, its bias (LayerNorm) 0
            param.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)

    drop_packed_weights(model)
