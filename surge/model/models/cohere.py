"""Cohere (Command R): attention and MLP in parallel from one LayerNorm (weight, no bias) per layer, h + attn(n) +
mlp(n); GPT-J's interleaved rope; logits multiplied by logit_scale; tied embeddings by default. With use_qk_norm, q
and k go through a LayerNorm per head, each head with its own weight, before rope."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from surge.attention.backend import AttentionMetadata
from surge.model.arch import cfg_get, head_dim
from surge.model.layers.norm import LayerNorm
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters
from surge.model.models.llama import DecoderAttention, LlamaForCausalLM


class HeadLayerNorm(nn.Module):
    """LayerNorm over each head's channels (no bias), a weight row per head: [heads, head_dim], this rank's heads
    [first_head, first_head + heads) of the checkpoint's."""

    def __init__(self, num_heads: int, head_size: int, first_head: int, eps: float) -> None:
        super().__init__()
        self.eps, self.first_head = eps, first_head
        self.weight = nn.Parameter(torch.ones(num_heads, head_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        heads, size = param.shape
        if loaded.dim() != 2 or loaded.shape[1] != size or loaded.shape[0] < self.first_head + heads:
            raise ValueError(f"per-head norm weight of shape {tuple(loaded.shape)} does not hold heads "
                             f"{self.first_head}..{self.first_head + heads} of size {size}")
        param.data.copy_(loaded.narrow(0, self.first_head, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        normed = F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class CohereAttention(DecoderAttention):
    def __init__(self, tc, sliding_window, rotary, *, bias: bool, qk_norm: bool) -> None:
        super().__init__(tc, sliding_window, rotary, qkv_bias=bias, o_bias=bias)
        eps, shard = cfg_get(tc, "layer_norm_eps", 1e-5), self.qkv_proj.shard
        # Per-head weights: applied here, not by the prologue (whose q/k norm is an RMSNorm shared by the heads).
        self.head_q_norm = HeadLayerNorm(self.num_heads, self.head_dim, shard.q_start, eps) if qk_norm else None
        self.head_k_norm = HeadLayerNorm(self.num_kv_heads, self.head_dim, shard.kv_start, eps) if qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.head_q_norm is not None:
            q, k = self.head_q_norm(q), self.head_k_norm(k)
        out = self.attn(q, k, v, meta, self.prologue(positions))
        return self.o_proj(out.flatten(1))


class ParallelDecoderLayer(nn.Module):
    """h + attn(norm(h)) + mlp(norm(h)), added in HF's order: the layer hands on (mlp, h + attn) as Llama's
    (x, residual), so the next layer's x + residual is HF's sum."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = LayerNorm(hidden, eps, bias=False)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            h, normed = x, self.input_layernorm(x)
        else:
            normed, h = self.input_layernorm(x, residual)
        return self.mlp(normed), h + self.self_attn(positions, normed, meta)


class CohereForCausalLM(LlamaForCausalLM):
    weight_mapper = LlamaForCausalLM.weight_mapper.extend(renames=(
        (r"\.self_attn\.q_norm\.", ".self_attn.head_q_norm."), (r"\.self_attn\.k_norm\.", ".self_attn.head_k_norm.")))

    def __init__(self, config, quant_config=None) -> None:
        super().__init__(config, quant_config)
        hidden, eps = self.tc.hidden_size, cfg_get(self.tc, "layer_norm_eps", 1e-5)
        self.layers = nn.ModuleList(ParallelDecoderLayer(hidden, eps, layer.self_attn, layer.mlp)
                                    for layer in self.layers)
        self.norm = LayerNorm(hidden, eps, bias=False)
        self.logit_scale = float(cfg_get(self.tc, "logit_scale", 1.0))

    def make_rotary(self, layer_type: str) -> RotaryEmbedding:
        return RotaryEmbedding(head_dim(self.tc), self.config.max_model_len, rope_parameters(self.tc, layer_type),
                               interleaved=True)

    def make_attention(self, layer_index, sliding_window, rotary) -> nn.Module:
        tc = self.tc
        return CohereAttention(tc, sliding_window, rotary, bias=bool(cfg_get(tc, "attention_bias", False)),
                               qk_norm=bool(cfg_get(tc, "use_qk_norm", False)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return logits * self.logit_scale if logits is not None else None
