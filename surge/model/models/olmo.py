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
from surge.distributed.parallel_state import get_tp_group
from surge.model.arch import cfg_get
from surge.model.layers.norm import LayerNorm
from surge.model.layers.norm import RMSNorm
from surge.model.layers.rotary import RotaryEmbedding
from surge.model.models.llama import DecoderAttention, LlamaForCausalLM

OLMO_LAYER_NORM_EPS = 1e-5  # HF's OlmoLayerNorm hard-codes it; the config has no field for it


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection (every head) whose heads tensor parallelism splits: a rank holds the weight
    of its slice [start, start + size) of total_size channels, and the sum of squares is summed over the ranks (an
    all-reduce of one float per token), each slice held by `replicas` ranks counted once."""

    def __init__(self, total_size: int, start: int, size: int, eps: float, replicas: int = 1) -> None:
        super().__init__()
        self.total_size, self.start, self.eps, self.replicas = total_size, start, eps, replicas
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.total_size,):
            raise ValueError(f"norm weight of shape {tuple(loaded.shape)}, expected ({self.total_size},)")
        param.data.copy_(loaded.narrow(0, self.start, param.shape[0]))

    def sum_of_squares(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the whole projection's sum of squares, [T, 1] float32."""
        partial = x.float().pow(2).sum(-1, keepdim=True)
        return partial / self.replicas if self.replicas > 1 else partial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.weight.shape[0] == self.total_size:  # one rank holds it all
            mean_square = xf.pow(2).mean(-1, keepdim=True)
        else:
            mean_square = get_tp_group().all_reduce(self.sum_of_squares(x)) / self.total_size
        return (self.weight * (xf * torch.rsqrt(mean_square + self.eps))).to(x.dtype)  # HF's order (Olmo2RMSNorm)


class OlmoAttention(DecoderAttention):
    """Llama's attention, with optionally an RMSNorm over the whole q and k projections (`projection_norm`) and q, k,
    v clamped to [-clip_qkv, clip_qkv] (after the norm, as OLMoE orders them)."""

    def __init__(self, tc, sliding_window: int | None, rotary: RotaryEmbedding | None, *, bias: bool,
                 projection_norm: bool, clip_qkv: float | None) -> None:
        super().__init__(tc, sliding_window, rotary, qkv_bias=bias, o_bias=bias)
        eps, d, shard = cfg_get(tc, "rms_norm_eps", 1e-5), self.head_dim, self.qkv_proj.shard
        total_kv_heads, tp = self.qkv_proj.total_num_kv_heads, get_tp_group().world_size
        kv_replicas = tp // total_kv_heads if tp > total_kv_heads else 1  # ranks sharing each KV head
        self.q_norm = ProjectionRMSNorm(tc.num_attention_heads * d, shard.q_start * d, self.q_size, eps) \
            if projection_norm else None
        self.k_norm = ProjectionRMSNorm(total_kv_heads * d, shard.kv_start * d, self.kv_size, eps, kv_replicas) \
            if projection_norm else None
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
            layer.input_layernorm = LayerNorm(hidden, OLMO_LAYER_NORM_EPS, affine=False)
            layer.post_attention_layernorm = LayerNorm(hidden, OLMO_LAYER_NORM_EPS, affine=False)
        self.norm = LayerNorm(hidden, OLMO_LAYER_NORM_EPS, affine=False)

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

    def make_attention(self, layer_index, sliding_window, rotary) -> nn.Module:
        tc = self.tc
        return OlmoAttention(tc, sliding_window, rotary, bias=bool(cfg_get(tc, "attention_bias", False)),
                             projection_norm=True, clip_qkv=cfg_get(tc, "clip_qkv"))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 2 with sliding and full layers: the window per layer and the rope parameters per layer type come from
    config.layer_types through Llama's constructor."""
