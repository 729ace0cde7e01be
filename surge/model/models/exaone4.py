"""EXAONE 4: post-norms instead of pre-norms (x + norm(attn(x)), then x + norm(mlp(x))), per-head q/k RMSNorm before
rope, and a hybrid of sliding-window and full layers in which only the sliding layers use rope (global NoPE). With
no sliding_window at all, every layer is full and uses rope.
"""
from __future__ import annotations

import torch
from torch import nn

from surge.attention.backend import AttentionMetadata
from surge.model.arch import CausalLM, cfg_get, head_dim
from surge.model.layers.embedding import VocabParallelEmbedding
from surge.model.layers.norm import RMSNorm
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters
from surge.model.models.llama import MLP, DecoderAttention


class Exaone4DecoderLayer(nn.Module):
    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Exaone4ForCausalLM(CausalLM):
    def __init__(self, config, quant_config=None) -> None:
        super().__init__(config, quant_config)
        tc = self.tc
        hidden, eps = tc.hidden_size, cfg_get(tc, "rms_norm_eps", 1e-5)
        self.embed_tokens = VocabParallelEmbedding(tc.vocab_size, hidden)
        # HF: rope where the model has no window at all, else only on the sliding layers.
        has_window = cfg_get(tc, "sliding_window") is not None
        rotary = RotaryEmbedding(head_dim(tc), config.max_model_len, rope_parameters(tc))
        layers = []
        for layer_type in config.layer_types:
            sliding = layer_type == "sliding_attention"
            attn = DecoderAttention(tc, config.sliding_window if sliding else None,
                                    rotary if sliding or not has_window else None, qk_norm=True)
            mlp = MLP(hidden, tc.intermediate_size, act=cfg_get(tc, "hidden_act", "silu"))
            layers.append(Exaone4DecoderLayer(hidden, eps, attn, mlp))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = self.make_lm_head(self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)
