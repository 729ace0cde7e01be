"""Qwen3-MoE: the Qwen3 decoder with a mixture of experts as the feed-forward block of its sparse layers.

A layer is sparse unless listed in mlp_only_layers, and every decoder_sparse_step-th layer is (as HF transformers
decides); the others keep the dense MLP. No shared expert (unlike Qwen2-MoE).
"""
from __future__ import annotations

import re

from torch import nn

from surge.model.layers.moe import SparseMoeBlock
from surge.model.models.llama import Qwen3ForCausalLM

# model.layers.N.mlp.experts.E.gate_proj.weight (per expert, as on the hub) or model.layers.N.mlp.experts.gate_up_proj
# (stacked, as HF transformers 5 holds them in memory).
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?:(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight|"
                     r"(?P<stacked>gate_up|down)_proj)$")


def is_sparse_layer(cfg: dict, layer_index: int) -> bool:
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    step = cfg.get("decoder_sparse_step") or 1
    return (layer_index not in (cfg.get("mlp_only_layers") or []) and num_experts > 0
            and (layer_index + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, cfg: dict, layer_index: int) -> nn.Module:
        if not is_sparse_layer(cfg, layer_index):
            return super().make_mlp(cfg, layer_index)
        return SparseMoeBlock(cfg["hidden_size"], cfg.get("num_experts") or cfg["num_local_experts"],
                              cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                              bool(cfg.get("norm_topk_prob", False)))

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        m = _EXPERT.match(name.removeprefix("model."))
        if m is None:
            return super().checkpoint_name_to_param(name)
        if m["stacked"]:
            return f"{m['prefix']}.{m['stacked']}_proj", (m["stacked"], None)
        param = "down_proj" if m["proj"] == "down" else "gate_up_proj"
        return f"{m['prefix']}.{param}", (m["proj"], int(m["expert"]))
