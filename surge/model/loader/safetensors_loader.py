"""Load an HF-format checkpoint (one or many safetensors shards) into a model through its weight loaders."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from surge.config import ModelConfig
from surge.model.layers.linear import default_weight_loader
from surge.model.models.registry import get_model_class


def build_model(config: ModelConfig, device: torch.device) -> nn.Module:
    cls = get_model_class(config.architecture)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device):
            model = cls(config.hf_config, config.layer_types, config.sliding_window, config.max_model_len)
    finally:
        torch.set_default_dtype(old_dtype)
    return model.eval()


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(model_dir)!r}: no *.safetensors weight files found")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target = model.checkpoint_name_to_param(name)
                if target is None:
                    continue
                param_name, shard_id = target
                if param_name not in params:
                    raise ValueError(f"{file.name}: checkpoint tensor {name!r} matches no parameter of "
                                     f"{type(model).__name__}")
                param = params[param_name]
                tensor = f.get_tensor(name).to(param.dtype)
                loader = getattr(param, "weight_loader", None)
                try:
                    if loader is None:
                        default_weight_loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(f"{file.name}: tensor {name!r}: {e}") from None
                loaded.add(param_name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"model={str(model_dir)!r}: checkpoint lacks weights for {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
