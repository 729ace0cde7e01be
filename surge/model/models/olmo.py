"""OLMo, OLMo 2 and OLMo 3 (AllenAI): the Llama decoder with OLMo's norms.

OLMo: LayerNorm without weight or bias (eps 1e-5, fixed by HF) in Llama's places, and clip_qkv clamping q, k and v.
OLMo 2: norms after the blocks only (x + post_attention_layernorm(attn(x)), x + post_feedforward_layernorm(mlp(x))),
and an RMSNorm over the whole q and k projections (all heads at once, before the head split).
OLMo 3: OLMo 2 with sliding and full layers (layer_types), each kind with its own rope parameters.
"""
from __future__ import annotations

import torch
from torch import nn

from surge.attention.backend import AttentionMetadata, Prologue
from surge.config import ModelConfig, ParallelConfig
from surge.model.arch import cfg_get
from surge.model.layers.layernorm import LayerNorm
from surge.model.layers.norm import RMSNorm
from surge.model.layers.rotary import RotaryEmbedding
from surge.model.models.llama import DecoderAttention, LlamaForCausalLM

OLMO_LAYER_NORM_EPS = 1e-5  # HF's OlmoLayerNorm hard-codes it; the config has no field for it


class OlmoAttention(DecoderAttention):
    """Llama's attention, with optionally an RMSNorm over the whole q and k projections (`projection_norm`) and q, k,
    v clamped to [-clip_qkv, clip_qkv] (after the norm, as OLMoE orders them)."""

    def __init__(self, tc, sliding_window: int | None, rotary: RotaryEmbedding | None, *, bias: bool,
                 projection_norm: bool, clip_qkv: float | None) -> None:
        super().__init__(tc, sliding_window, rotary, qkv_bias=bias, o_bias=bias)
        eps = cfg_get(tc, "rms_norm_eps", 1e-5)
        # The norms span every head: one rank must hold them all (check_parallel refuses tensor parallelism).
        self.q_norm = RMSNorm(self.q_size, eps) if projection_norm else None
        self.k_norm = RMSNorm(self.kv_size, eps) if projection_norm else None
        self.clip_qkv = clip_qkv

    def prologue(self, positions: torch.Tensor) -> Prologue:
        rotary = self.rotary  # rope only: q_norm / k_norm are not per-head norms
        return Prologue(positions, rotary.cos_cache, rotary.sin_cache, interleaved=rotary.interleaved)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, meta, self.prologue(positions))
        return self.o_proj(out.flatten(1))


def refuse_tensor_parallel_projection_norm(config: ModelConfig, parallel: ParallelConfig) -> None:
    tp = parallel.tensor_parallel_size
    if tp > 1:
        raise ValueError(f"tensor_parallel_size={tp} is not supported for {config.architecture}: its q_norm / k_norm "
                         "normalize the whole q / k projection (every head), which the ranks split; use "
                         "tensor_parallel_size=1")


class PostNormDecoderLayer(nn.Module):
    """OLMo 2's layer: h = h + post_attention_layernorm(attn(h)); h = h + post_feedforward_layernorm(mlp(h)). Speaks
    Llama's (x, residual) protocol, the hidden state being x + residual, so the model's loop and final norm serve."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, positions, x, residual, meta):
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(positions, h, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class OlmoForCausalLM(LlamaForCausalLM):
    def __init__(self, config, quant_config=None) -> None:
        super().__init__(config, quant_config)
        hidden = self.tc.hidden_size
        for layer in self.layers:  # parameter-free LayerNorms where Llama has RMSNorms
            layer.input_layernorm = LayerNorm(hidden, OLMO_LAYER_NORM_EPS, weight=False)
            layer.post_attention_layernorm = LayerNorm(hidden, OLMO_LAYER_NORM_EPS, weight=False)
        self.norm = LayerNorm(hidden, OLMO_LAYER_NORM_EPS, weight=False)

    def make_attention(self, layer_index, sliding_window, rotary) -> nn.Module:
        tc = self.tc
        return OlmoAttention(tc, sliding_window, rotary, bias=bool(cfg_get(tc, "attention_bias", False)),
                             projection_norm=False, clip_qkv=cfg_get(tc, "clip_qkv"))


class Olmo2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, quant_config=None) -> None:
        super().__init__(config, quant_config)
        eps = cfg_get(self.tc, "rms_norm_eps", 1e-5)
        self.layers = nn.ModuleList(PostNormDecoderLayer(self.tc.hidden_size, eps, layer.self_attn, layer.mlp)
                                    for layer in self.layers)

    @classmethod
    def check_parallel(cls, config: ModelConfig, parallel: ParallelConfig) -> None:
        refuse_tensor_parallel_projection_norm(config, parallel)
        super().check_parallel(config, parallel)

    def make_attention(self, layer_index, sliding_window, rotary) -> nn.Module:
        tc = self.tc
        return OlmoAttention(tc, sliding_window, rotary, bias=bool(cfg_get(tc, "attention_bias", False)),
                             projection_norm=True, clip_qkv=cfg_get(tc, "clip_qkv"))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 2 with sliding and full layers: the window per layer and the rope parameters per layer type come from
    config.layer_types through Llama's constructor."""
