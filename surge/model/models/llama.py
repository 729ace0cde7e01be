"""Llama-family decoder (Llama, Qwen2, Qwen3): one implementation, switched by config.

Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm; layer_types may mix sliding-window and full attention.
"""
from __future__ import annotations

import torch
from torch import nn

from surge.attention.backend import AttentionMetadata, Prologue
from surge.model.layers.activation import SiluAndMul
from surge.model.layers.attention import Attention
from surge.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from surge.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from surge.model.layers.norm import RMSNorm
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters


class DecoderAttention(nn.Module):
    def __init__(self, cfg: dict, layer_type: str, sliding_window: int | None, qkv_bias: bool, qk_norm: bool,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        total_heads = cfg["num_attention_heads"]
        total_kv_heads = cfg.get("num_key_value_heads") or total_heads
        self.head_dim = cfg.get("head_dim") or hidden // total_heads
        attention_bias = bool(cfg.get("attention_bias", False))  # Llama: bias on q, k, v and o
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads,
                                          bias=qkv_bias or attention_bias)
        # This rank's heads: all of them with one rank.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shard = self.qkv_proj.shard
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=attention_bias,
                                        input_shard=(shard.q_start * self.head_dim, shard.q_count * self.head_dim))
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.rotary = rotary
        window = sliding_window if layer_type == "sliding_attention" else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        qn, kn = self.q_norm, self.k_norm
        prologue = Prologue(positions, self.rotary.cos_cache, self.rotary.sin_cache,
                            qn.weight if qn is not None else None, kn.weight if kn is not None else None,
                            qn.eps if qn is not None else 0.0)
        out = self.attn(q, k, v, meta, prologue)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, {0: intermediate, 1: intermediate}, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Attention, then the feed-forward block the model chose for this layer (dense MLP or mixture of experts)."""

    def __init__(self, cfg: dict, layer_type: str, sliding_window: int | None, qkv_bias: bool, qk_norm: bool,
                 rotary: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = DecoderAttention(cfg, layer_type, sliding_window, qkv_bias, qk_norm, rotary)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (parameter name fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias = False
    qk_norm = False

    def __init__(self, cfg: dict, layer_types: tuple[str, ...], sliding_window: int | None, max_position: int) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
        rotary = RotaryEmbedding(head_dim, max_position, rope_parameters(cfg))
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, layer_types[i], sliding_window, self.qkv_bias, self.qk_norm, rotary,
                         self.make_mlp(cfg, i))
            for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], hidden)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_mlp(self, cfg: dict, layer_index: int) -> nn.Module:
        """The feed-forward block of one layer; mixture-of-experts models choose per layer."""
        return MLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("mlp_bias", False))

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; `compute_logits` maps the rows that need them to logits."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [n, V]; with tensor parallelism on rank 0 only (None elsewhere)."""
        return self.lm_head(hidden)

    def checkpoint_name_to_param(self, name: str) -> tuple[str, str | int | None] | None:
        """Map a checkpoint tensor name to (parameter name, shard id); None for tensors to skip."""
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        for ckpt, (param, shard_id) in self.packed_modules_mapping.items():
            if f".{ckpt}." in name:
                return name.replace(ckpt, param), shard_id
        return name, None


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
