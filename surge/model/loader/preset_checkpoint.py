"""A preset's random weights written as an HF-format checkpoint (config.json + safetensors shards with HF tensor
names), so disk loads and the weight cache can be measured on real shapes with no hub. Loading it back gives the
very model `load_format="dummy"` builds for the same preset, dtype and seed.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from surge.model.layers.linear import MergedColumnParallelLinear
from surge.model.layers.moe import FusedMoE
from surge.model.loader.base import load_from_disk
from surge.model.presets import preset_model_config

_SHARD_BYTES = 4 << 30


def hf_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A one-rank model's parameters under their HF checkpoint names: merged projections split back (qkv_proj ->
    q/k/v_proj, gate_up_proj -> gate/up_proj) by their shard layout, stacked experts split per expert; a tied LM head
    is left out, as HF saves it."""
    inverse = {(param, shard): ckpt for ckpt, (param, shard) in model.weight_mapper.packed.items()}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():  # tied weights appear once, under the embedding's name
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        parent, _, fragment = module_name.rpartition(".")
        merged = isinstance(module, MergedColumnParallelLinear) and list(module.shard_layout) != [None]
        if isinstance(module, FusedMoE):  # stacked experts -> one tensor per expert and projection, as on the hub
            assert module.num_local_experts == module.num_experts and module.local_intermediate == module.intermediate
            for expert, weight in enumerate(param):
                if leaf == "down_proj":
                    yield _hf_name(f"{module_name}.{expert}.down_proj.weight"), weight
                else:
                    gate, up = weight.chunk(2)
                    yield _hf_name(f"{module_name}.{expert}.gate_proj.weight"), gate
                    yield _hf_name(f"{module_name}.{expert}.up_proj.weight"), up
        elif merged:
            assert module.tp_size == 1, "a checkpoint is written from a one-rank model"
            for shard_id, (offset, rows, _) in module.shard_layout.items():
                yield _hf_name(f"{parent}.{inverse[(fragment, shard_id)]}.{leaf}"), param.narrow(0, offset, rows)
        else:
            yield _hf_name(name), param


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _shard_groups(tensors: Iterator[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors (views, nothing copied) grouped into shards of at most `limit` bytes (or one tensor)."""
    groups: list[list[tuple[str, torch.Tensor]]] = []
    size = limit
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += nbytes
    return groups


def write_preset_checkpoint(preset: str, out_dir: str | Path, dtype: str | torch.dtype, device: torch.device,
                            seed: int = 0, shard_bytes: int = _SHARD_BYTES) -> Path:
    """Write `preset` (random weights from `seed`, generated on `device`) to `out_dir` unless it already holds it;
    a directory holding anything else is an error. Written beside, then renamed into place."""
    out_dir = Path(out_dir)
    mc = preset_model_config(preset, dtype, device)
    dtype_name = str(mc.dtype).removeprefix("torch.")
    marker = {"surge_preset": preset, "surge_seed": seed, "dtype": dtype_name}
    if out_dir.exists():
        config_file = out_dir / "config.json"
        found = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if {k: found.get(k) for k in marker} != marker or not any(out_dir.glob("*.safetensors")):
            raise ValueError(f"checkpoint_dir={str(out_dir)!r} exists but does not hold preset {preset!r} "
                             f"({dtype_name}, seed {seed}); remove it or choose another directory")
        return out_dir
    model = load_from_disk(mc, device, seed)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        groups = _shard_groups(hf_tensors(model), shard_bytes)
        index, total = {}, 0
        for i, group in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            shard = {name: t.detach().to("cpu", copy=True) for name, t in group}  # own storage each
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            index.update({name: file for name in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
            del shard
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": index}, indent=2))
        config = {**mc.hf_config, "torch_dtype": dtype_name, **marker}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
