"""PEFT LoRA adapters: a directory's adapter_config.json and adapter_model.safetensors, read into CPU tensors placed
on a model's linear layers (this rank's share of each), the scaling folded into B.

Tensors are named as PEFT saves them, `base_model.model.<checkpoint module>.lora_A.weight` [r, in] and `lora_B.weight`
[out, r]; the checkpoint module is mapped by the model's own WeightMapper, so `q_proj` lands in `qkv_proj`'s "q"
rows exactly as the base weight does. What the engine cannot apply is refused by name: DoRA, modules_to_save, LoRA on
embeddings or the LM head, biases, per-module rank or alpha patterns.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from surge.config import read_json_object
from surge.model.layers.linear import Linear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # names, or one regex / "all-linear"

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _unsupported(path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {path!r}: {what} is not supported")


def read_adapter_config(path: str | Path, max_lora_rank: int | None = None) -> AdapterConfig:
    """adapter_config.json of the adapter directory, checked: a LoRA the engine can apply, of rank <= max_lora_rank."""
    where = str(path)
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter {where!r}: not a directory (a PEFT adapter directory with {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE} is expected)")
    cfg = read_json_object(directory / CONFIG_FILE, f"LoRA adapter {where!r}")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _unsupported(where, f"peft_type={peft_type!r} (only LORA)")
    if cfg.get("use_dora"):
        raise _unsupported(where, "use_dora=true (DoRA)")
    if cfg.get("modules_to_save"):
        raise _unsupported(where, f"modules_to_save={cfg['modules_to_save']!r} (fully trained copies of modules)")
    if cfg.get("bias", "none") != "none":
        raise _unsupported(where, f"bias={cfg['bias']!r} (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise _unsupported(where, "fan_in_fan_out=true")
    for name in ("rank_pattern", "alpha_pattern"):
        if cfg.get(name):
            raise _unsupported(where, f"{name}={cfg[name]!r} (one rank and one alpha for every module)")
    for name in ("use_qalora", "lora_bias"):
        if cfg.get(name):
            raise _unsupported(where, f"{name}=true")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA adapter {where!r}: r={rank!r} must be a positive integer")
    if max_lora_rank is not None and rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {where!r} has rank r={rank}, greater than max_lora_rank={max_lora_rank} "
                         "(--max-lora-rank)")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {where!r}: lora_alpha={alpha!r} must be a number")
    targets = cfg.get("target_modules")
    if isinstance(targets, list) and all(isinstance(t, str) for t in targets) and targets:
        targets = tuple(targets)
    elif not (isinstance(targets, str) and targets):
        raise ValueError(f"LoRA adapter {where!r}: target_modules={targets!r} must be a list of module names, a "
                         "regular expression or 'all-linear'")
    return AdapterConfig(rank, float(alpha), bool(cfg.get("use_rslora", False)), targets)


def linear_target_names(model: nn.Module) -> set[str]:
    """The module names (last component, as the checkpoint writes them) an adapter may target in this model."""
    leaves = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if is_adaptable(m)}
    packed = {ckpt for ckpt, (param, _) in model.weight_mapper.packed.items() if param in leaves}
    return leaves | packed


def is_adaptable(module: nn.Module) -> bool:
    return isinstance(module, Linear) and module.quantizable


def check_target_modules(path: str, config: AdapterConfig, model: nn.Module) -> None:
    if isinstance(config.target_modules, str):
        return  # "all-linear" or a regex: the tensors present say which modules it reached
    names = linear_target_names(model)
    for target in config.target_modules:
        leaf = target.rsplit(".", 1)[-1]
        if leaf in ("embed_tokens", "lm_head", "wte", "word_embeddings"):
            raise _unsupported(path, f"target module {target!r} (LoRA on embeddings or the LM head)")
        if leaf not in names:
            raise ValueError(f"LoRA adapter {path!r}: target module {target!r} is not a linear layer of this model; "
                             f"supported: {', '.join(sorted(names))}")


@dataclass
class LoRAAdapter:
    """An adapter on one rank: layer name -> slice index -> (A [r, in_local], B [rows, r] * scaling)."""
    path: str
    config: AdapterConfig
    layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def rank(self) -> int:
        return self.config.rank


def load_adapter(path: str | Path, model: nn.Module, max_lora_rank: int | None = None,
                 dtype: torch.dtype | None = None) -> LoRAAdapter:
    """Read and place an adapter for `model` (on any device, the meta device included: only its layers' shapes and
    names are read), in CPU memory, in `dtype` (default: float32)."""
    from safetensors.torch import load_file

    where = str(path)
    config = read_adapter_config(path, max_lora_rank)
    check_target_modules(where, config, model)
    weights_file = Path(path) / WEIGHTS_FILE
    if not weights_file.is_file():
        extra = " (adapter_model.bin is not read: pickle)" if (Path(path) / "adapter_model.bin").is_file() else ""
        raise ValueError(f"LoRA adapter {where!r}: {WEIGHTS_FILE} is missing{extra}")
    tensors = load_file(str(weights_file), device="cpu")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _TENSOR.match(key)
        if m is None:
            if "lora_embedding_" in key:
                raise _unsupported(where, f"tensor {key!r} (LoRA on embeddings)")
            if "lora_magnitude_vector" in key:
                raise _unsupported(where, f"tensor {key!r} (DoRA)")
            raise _unsupported(where, f"tensor {key!r} (only lora_A / lora_B weights of linear layers; a saved "
                                      "module or bias is not)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    modules = dict(model.named_modules())
    layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for ckpt_module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"LoRA adapter {where!r}: {ckpt_module!r} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        if a.shape[0] > config.rank and max_lora_rank is not None and a.shape[0] > max_lora_rank:
            raise ValueError(f"LoRA adapter {where!r}: {ckpt_module!r} has rank {a.shape[0]}, greater than "
                             f"max_lora_rank={max_lora_rank} (--max-lora-rank)")
        mapped = model.checkpoint_name_to_param(ckpt_module + ".weight")
        layer_name = mapped[0].rsplit(".", 1)[0] if mapped is not None else None
        layer = modules.get(layer_name) if layer_name is not None else None
        if layer is None or not is_adaptable(layer):
            raise _unsupported(where, f"target {ckpt_module!r} (not a linear layer of this model: LoRA applies to "
                                      "the attention and MLP projections)")
        b = b.float() * config.scaling
        parts = layer.lora_parts(mapped[1], a.float(), b, f"{ckpt_module!r} in {where!r}")
        placed = layers.setdefault(layer_name, {})
        for j, (aj, bj) in parts.items():
            placed[j] = (aj.to(dtype or torch.float32).contiguous(), bj.to(dtype or torch.float32).contiguous())
    if not layers:
        raise ValueError(f"LoRA adapter {where!r}: {WEIGHTS_FILE} holds no lora_A / lora_B weights")
    return LoRAAdapter(where, config, layers)
