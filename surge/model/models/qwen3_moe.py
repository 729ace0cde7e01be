"""Qwen3-MoE: the Qwen3 decoder with a mixture of experts as the feed-forward block of its sparse layers.

A layer is sparse unless listed in mlp_only_layers, and every decoder_sparse_step-th layer is (as HF transformers
decides); the others keep the dense MLP. No shared expert (unlike Qwen2-MoE).
"""
from __future__ import annotations

import re

from torch import nn

from surge.model.arch import cfg_get, require
from surge.model.layers.moe import SparseMoeBlock
from surge.model.models.llama import Qwen3ForCausalLM

# model.layers.N.mlp.experts.E.gate_proj.weight (per expert, as on the hub) or model.layers.N.mlp.experts.gate_up_proj
# (stacked, as HF transformers 5 holds them in memory).
# A quantized checkpoint's per-expert scales (fp8: weight_scale_inv, weight_scale) load onto the layer's
# gate_up_proj_<name> / down_proj_<name>.
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?:(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\."
                     r"(?P<tensor>weight|weight_scale_inv|weight_scale)|(?P<stacked>gate_up|down)_proj)$")


def is_sparse_layer(tc, layer_index: int) -> bool:
    num_experts = cfg_get(tc, "num_experts") or cfg_get(tc, "num_local_experts") or 0
    step = cfg_get(tc, "decoder_sparse_step") or 1
    return (layer_index not in (cfg_get(tc, "mlp_only_layers") or []) and num_experts > 0
            and (layer_index + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, layer_index: int) -> nn.Module:
        tc = self.tc
        if not is_sparse_layer(tc, layer_index):
            return super().make_mlp(layer_index)
        require(tc, "hidden_act", ("silu",))  # the fused experts compute SiLU
        return SparseMoeBlock(tc.hidden_size, cfg_get(tc, "num_experts") or tc.num_local_experts,
                              tc.num_experts_per_tok, tc.moe_intermediate_size,
                              bool(cfg_get(tc, "norm_topk_prob", False)))

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        return expert_param(name) or super().checkpoint_name_to_param(name)


def expert_param(name: str) -> tuple[str, tuple[str, int | None]] | None:
    """A routed expert's checkpoint tensor -> (the FusedMoE parameter, its shard id); None for other tensors. Scales
    of quantized experts (weight_scale, weight_scale_inv) go to the parameter of the same suffix."""
    m = _EXPERT.match(name.removeprefix("model."))
    if m is None:
        return None
    if m["stacked"]:
        return f"{m['prefix']}.{m['stacked']}_proj", (m["stacked"], None)
    param = "down_proj" if m["proj"] == "down" else "gate_up_proj"
    suffix = "" if m["tensor"] == "weight" else f"_{m['tensor']}"
    return f"{m['prefix']}.{param}{suffix}", (m["proj"], int(m["expert"]))
