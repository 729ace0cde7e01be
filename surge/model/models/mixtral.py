"""Mixtral: Mistral's attention with a sparse mixture of experts as every layer's feed-forward block (softmax over
the experts, top-k, always renormalized, as HF routes).

Checkpoints name the block `block_sparse_moe` and an expert's projections w1 (gate), w3 (up) and w2 (down); each
expert's intermediate size is intermediate_size.
"""
from __future__ import annotations

import re

from torch import nn

from surge.model.arch import require
from surge.model.layers.moe import SparseMoeBlock
from surge.model.models.mistral import MistralForCausalLM

# layers.N.mlp.experts.E.w1.weight (per expert, as on the hub) or layers.N.mlp.experts.gate_up_proj (stacked, as HF
# transformers 5 holds them in memory); names arrive with "model." stripped and block_sparse_moe renamed to mlp.
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?:(?P<expert>\d+)\.(?P<proj>w[123])\.weight|"
                     r"(?P<stacked>gate_up|down)_proj)$")
_PROJECTION = {"w1": "gate", "w3": "up", "w2": "down"}


class MixtralForCausalLM(MistralForCausalLM):
    weight_mapper = MistralForCausalLM.weight_mapper.extend(renames=((r"\.block_sparse_moe\.", ".mlp."),))

    def make_mlp(self, layer_index: int) -> nn.Module:
        tc = self.tc
        require(tc, "hidden_act", ("silu",))  # the fused experts compute SiLU
        return SparseMoeBlock(tc.hidden_size, tc.num_local_experts, tc.num_experts_per_tok, tc.intermediate_size,
                              norm_topk_prob=True)

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        mapped = super().checkpoint_name_to_param(name)
        m = _EXPERT.match(mapped[0]) if mapped is not None else None
        if m is None:
            return mapped
        if m["stacked"]:
            return f"{m['prefix']}.{m['stacked']}_proj", (m["stacked"], None)
        projection = _PROJECTION[m["proj"]]
        param = "down_proj" if projection == "down" else "gate_up_proj"
        return f"{m['prefix']}.{param}", (projection, int(m["expert"]))
