"""Granite (3.x): the Llama decoder with four scalars. The embeddings are multiplied by embedding_multiplier, the
attention softmax scale is attention_multiplier (not head_dim ** -0.5), each attention and MLP output is multiplied by
residual_multiplier before its residual add, and the logits are divided by logits_scaling.
"""
from __future__ import annotations

import torch
from torch import nn

from surge.attention.backend import AttentionMetadata
from surge.model.arch import cfg_get
from surge.model.layers.rotary import RotaryEmbedding
from surge.model.models.llama import MLP, DecoderAttention, LlamaForCausalLM


class ScaledAttention(DecoderAttention):
    def __init__(self, tc, sliding_window, rotary, residual_multiplier: float, **flags) -> None:
        super().__init__(tc, sliding_window, rotary, **flags)
        self.residual_multiplier = residual_multiplier

    def forward(self, positions, x, meta: list[AttentionMetadata]) -> torch.Tensor:
        return super().forward(positions, x, meta) * self.residual_multiplier


class ScaledMLP(MLP):
    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str, residual_multiplier: float) -> None:
        super().__init__(hidden, intermediate, bias, act)
        self.residual_multiplier = residual_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config, quant_config=None) -> None:
        tc = config.text_config
        self.embedding_multiplier = float(cfg_get(tc, "embedding_multiplier", 1.0))
        self.residual_multiplier = float(cfg_get(tc, "residual_multiplier", 1.0))
        self.logits_scaling = float(cfg_get(tc, "logits_scaling", 1.0))
        super().__init__(config, quant_config)

    def make_attention(self, layer_index: int, sliding_window: int | None,
                       rotary: RotaryEmbedding | None) -> nn.Module:
        tc = self.tc
        bias = bool(cfg_get(tc, "attention_bias", False))
        return ScaledAttention(tc, sliding_window, rotary, self.residual_multiplier, qkv_bias=bias, o_bias=bias,
                               scale=float(cfg_get(tc, "attention_multiplier", 1.0)))

    def make_mlp(self, layer_index: int) -> nn.Module:
        tc = self.tc
        return ScaledMLP(tc.hidden_size, tc.intermediate_size, bool(cfg_get(tc, "mlp_bias", False)),
                         cfg_get(tc, "hidden_act", "silu"), self.residual_multiplier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embedding_multiplier
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return logits / self.logits_scaling if logits is not None else None
