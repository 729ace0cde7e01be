"""StableLM (StableLmForCausalLM): LayerNorms (bias), Llama's gated MLP, partial rotary, optional q/k/v bias
(use_qkv_bias), optional LayerNorm on each query and key head with its own weights (qk_layernorm), and either the
pre-norm residual or the parallel one with a single norm (use_parallel_residual)."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from surge.model.arch import ShardId, cfg_get, head_dim
from surge.model.layers.linear import default_weight_loader
from surge.model.layers.rotary import RotaryEmbedding
from surge.model.models.layernorm_decoder import (LayerNormCausalLM, ParallelResidualLayer, PreNormLayer,
                                                  QKNormAttention)
from surge.model.models.llama import MLP, DecoderAttention

# model.layers.N.self_attn.q_layernorm.norms.H.weight: head H's LayerNorm (no bias)
_HEAD_NORM = re.compile(r"^(?P<param>.*\.[qk]_layernorm)\.norms\.(?P<head>\d+)\.weight$")


class PerHeadLayerNorm(nn.Module):
    """A LayerNorm without bias per head, over head_dim; this rank keeps heads [first, first + count)."""

    def __init__(self, first: int, count: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.first, self.eps = first, eps
        self.weight = nn.Parameter(torch.ones(count, head_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, head: int) -> None:
        if self.first <= head < self.first + param.shape[0]:  # another rank's head otherwise
            default_weight_loader(param[head - self.first], loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, count, head_dim]."""
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight


class StableLmForCausalLM(LayerNormCausalLM):
    def make_layer(self, layer_index: int, sliding_window: int | None, rotary: RotaryEmbedding) -> nn.Module:
        tc, hidden = self.tc, self.tc.hidden_size
        qkv_bias = bool(cfg_get(tc, "use_qkv_bias", False))
        if cfg_get(tc, "qk_layernorm", False):
            attn = QKNormAttention(tc, sliding_window, rotary, lambda first, count: PerHeadLayerNorm(
                first, count, head_dim(tc), self.eps), qkv_bias=qkv_bias)
        else:
            attn = DecoderAttention(tc, sliding_window, rotary, qkv_bias=qkv_bias)
        mlp = MLP(hidden, tc.intermediate_size, act=cfg_get(tc, "hidden_act", "silu"))
        if cfg_get(tc, "use_parallel_residual", False):
            return ParallelResidualLayer(hidden, self.eps, attn, mlp, shared_norm=True)
        return PreNormLayer(hidden, self.eps, attn, mlp)

    def checkpoint_name_to_param(self, name: str) -> tuple[str, ShardId] | None:
        m = _HEAD_NORM.match(name.removeprefix("model."))
        if m is not None:
            return f"{m['param']}.weight", int(m["head"])
        return super().checkpoint_name_to_param(name)
