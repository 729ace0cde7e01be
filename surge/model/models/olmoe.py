"""OLMoE (AllenAI): Llama's pre-norm layers with OLMo 2's RMSNorm over the whole q and k projections (then clip_qkv),
and a mixture of experts (softmax top-k, optionally renormalized: norm_topk_prob) as every layer's feed-forward block.

The experts' checkpoint layout is Qwen3-MoE's (per-expert tensors, or stacked as HF transformers 5 holds them), so
the class inherits its name mapping; the experts' size is intermediate_size.
"""
from __future__ import annotations

from torch import nn

from surge.model.arch import cfg_get, require
from surge.model.layers.moe import SparseMoeBlock
from surge.model.models.olmo import OlmoAttention
from surge.model.models.qwen3_moe import Qwen3MoeForCausalLM


class OlmoeForCausalLM(Qwen3MoeForCausalLM):
    def make_attention(self, layer_index, sliding_window, rotary) -> nn.Module:
        tc = self.tc
        # HF's OLMoE slides every layer by a sliding_window its config class does not declare (so Surge's
        # layer_types do not see it): refused rather than silently attending to everything.
        require(tc, "sliding_window", (None,))
        return OlmoAttention(tc, sliding_window, rotary, bias=bool(cfg_get(tc, "attention_bias", False)),
                             projection_norm=True, clip_qkv=cfg_get(tc, "clip_qkv"))

    def make_mlp(self, layer_index: int) -> nn.Module:
        tc = self.tc
        require(tc, "hidden_act", ("silu",))  # the fused experts compute SiLU
        return SparseMoeBlock(tc.hidden_size, tc.num_experts, tc.num_experts_per_tok, tc.intermediate_size,
                              bool(cfg_get(tc, "norm_topk_prob", False)))
