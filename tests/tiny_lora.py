"""Tiny PEFT LoRA adapters for the tiny models, written as PEFT saves them (adapter_config.json and
adapter_model.safetensors, `base_model.model.<module>.lora_A.weight` [r, in], `lora_B.weight` [out, r]), and the HF
reference with an adapter merged into the base weights (W + scaling * B @ A, as PEFT's merge_and_unload does).

peft is not in the venv, so the files are written here with PEFT's exact names and fields; B is random (PEFT starts it
at zero, which would hide every mistake)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _linear_shapes(model) -> dict[str, tuple[int, int]]:
    """checkpoint module name (model.layers.N.self_attn.q_proj) -> (in, out)."""
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name != "lm_head"}


def make_adapter(path: Path, base_dir: Path, rank: int, alpha: float, targets=ATTENTION + MLP,
                 use_rslora: bool = False, seed: int = 0, std: float = 0.1, layers=None, **config_extra) -> Path:
    """An adapter on `targets` (module names) of every layer, or of `layers` only."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in _linear_shapes(base).items():
        leaf = name.rsplit(".", 1)[-1]
        layer = int(name.split(".")[2])
        if leaf not in targets or (layers is not None and layer not in layers):
            continue
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir), "r": rank,
              "lora_alpha": alpha, "use_rslora": use_rslora, "target_modules": list(targets), "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_dora": False,
              "rank_pattern": {}, "alpha_pattern": {}, **config_extra}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def merged_hf_model(base_dir: Path, adapter_dir: Path | None):
    """The HF model with the adapter merged into its weights (None: the base model)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    r = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    from safetensors.torch import load_file
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            modules[name].weight += scaling * (b @ a)
    return model


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
