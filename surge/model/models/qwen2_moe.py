"""Qwen2-MoE: the Qwen2 decoder (q/k/v biases per config.qkv_bias) whose sparse layers add a shared expert to the
routed experts: a dense MLP on every token, scaled by sigmoid(shared_expert_gate(x)).

Sparse layers as in Qwen3-MoE (mlp_only_layers, decoder_sparse_step); routing renormalized per norm_topk_prob.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from surge.distributed.parallel_state import get_tp_group
from surge.model.arch import cfg_get, require
from surge.model.layers.linear import Linear
from surge.model.layers.moe import SparseMoeBlock, select_experts
from surge.model.models.llama import MLP, DecoderAttention
from surge.model.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts plus a gated shared expert, which runs on every token."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool,
                 shared_intermediate: int) -> None:
        super().__init__(hidden, num_experts, top_k, intermediate, norm_topk_prob)
        self.shared_expert = MLP(hidden, shared_intermediate)
        self.shared_expert_gate = Linear(hidden, 1, quantizable=False)  # replicated, like the router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(F.linear(x, self.gate.weight), self.top_k, self.norm_topk_prob, x.dtype)
        routed = get_tp_group().all_reduce(self.experts(x, weights, ids))
        shared = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return routed + shared


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = False

    @classmethod
    def check_parallel(cls, config, parallel) -> None:
        super().check_parallel(config, parallel)
        tp, shared = parallel.tensor_parallel_size, cfg_get(config.text_config, "shared_expert_intermediate_size")
        if shared and shared % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                             f"shared_expert_intermediate_size={shared}")

    def make_attention(self, layer_index: int, sliding_window: int | None, rotary) -> nn.Module:
        return DecoderAttention(self.tc, sliding_window, rotary, qkv_bias=bool(cfg_get(self.tc, "qkv_bias", True)))

    def make_mlp(self, layer_index: int) -> nn.Module:
        tc = self.tc
        if not is_sparse_layer(tc, layer_index):
            return MLP(tc.hidden_size, tc.intermediate_size, act=cfg_get(tc, "hidden_act", "silu"))
        require(tc, "hidden_act", ("silu",))  # the fused experts compute SiLU
        return SharedExpertMoeBlock(tc.hidden_size, tc.num_experts, tc.num_experts_per_tok, tc.moe_intermediate_size,
                                    bool(cfg_get(tc, "norm_topk_prob", False)), tc.shared_expert_intermediate_size)
