"""Decoders normalized by LayerNorm (GPT-NeoX, Phi-2, StableLM, StarCoder2): the blocks they share, and a base class
that builds the embedding, the layers, the final LayerNorm and the LM head, each family choosing its layer.

Two residual layouts: pre-norm (Llama's, with LayerNorms) and parallel, where attention and MLP both read the layer's
input, x + attn(ln1(x)) + mlp(ln2(x)), with ln2 = ln1 in Phi-2 and StableLM.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from surge.attention.backend import AttentionMetadata
from surge.model.arch import CausalLM, cfg_get, head_dim
from surge.model.layers.activation import Act
from surge.model.layers.embedding import VocabParallelEmbedding
from surge.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from surge.model.layers.norm import LayerNorm
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters
from surge.model.models.llama import DecoderAttention, DecoderLayer


class PlainMLP(nn.Module):
    """fc2(act(fc1(x))), not gated (Phi-2's fc1 / fc2; GPT-NeoX's and StarCoder2's are renamed to them)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str, act_field: str = "hidden_act") -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, intermediate, bias=bias)
        self.fc2 = RowParallelLinear(intermediate, hidden, bias=bias)
        self.act = Act(act, act_field)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class QKNormAttention(DecoderAttention):
    """DecoderAttention whose query and key heads go through their own norms ([T, heads, head_dim] -> same) before
    the rotary embedding: Phi-2's one LayerNorm for every head, StableLM's one per head. `make_norm(first, count)`
    builds the norm of this rank's heads [first, first + count) (query heads, then KV heads)."""

    def __init__(self, tc, sliding_window: int | None, rotary: RotaryEmbedding | None,
                 make_norm: Callable[[int, int], nn.Module], **flags) -> None:
        super().__init__(tc, sliding_window, rotary, **flags)
        shard = self.qkv_proj.shard
        self.q_layernorm = make_norm(shard.q_start, shard.q_count)
        self.k_layernorm = make_norm(shard.kv_start, shard.kv_count)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_layernorm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_layernorm(k.view(-1, self.num_kv_heads, self.head_dim))
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta, self.prologue(positions))
        return self.o_proj(out.flatten(1))


class PreNormLayer(DecoderLayer):
    """Llama's layer with LayerNorms (with bias): h = x + attn(ln1(x)); h + mlp(ln2(h))."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__(hidden, eps, self_attn, mlp)
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = LayerNorm(hidden, eps)


class ParallelResidualLayer(nn.Module):
    """x + attn(ln1(x)) + mlp(ln2(x)), LayerNorms with bias; with shared_norm the MLP reads ln1(x) too (one norm
    per layer)."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module, shared_norm: bool) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = None if shared_norm else LayerNorm(hidden, eps)

    def forward(self, positions, x, residual, meta):
        """As DecoderLayer: the residual stream arrives apart from the last layer's output and is summed here."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        mlp_in = h if self.post_attention_layernorm is None else self.post_attention_layernorm(residual)
        return self.self_attn(positions, h, meta) + self.mlp(mlp_in), residual


class LayerNormCausalLM(CausalLM):
    """embed_tokens, layers (from `make_layer`), a final LayerNorm `norm` (with bias), lm_head; one rotary table for
    all layers (partial where the rope parameters' partial_rotary_factor says so)."""
    eps_field = "layer_norm_eps"

    def __init__(self, config, quant_config=None) -> None:
        super().__init__(config, quant_config)
        tc = self.tc
        self.eps = float(cfg_get(tc, self.eps_field, 1e-5))
        self.embed_tokens = VocabParallelEmbedding(tc.vocab_size, tc.hidden_size)
        rotary = RotaryEmbedding(head_dim(tc), config.max_model_len, rope_parameters(tc))
        self.layers = nn.ModuleList(
            self.make_layer(i, config.sliding_window if layer_type == "sliding_attention" else None, rotary)
            for i, layer_type in enumerate(config.layer_types))
        self.norm = LayerNorm(tc.hidden_size, self.eps)
        self.lm_head = self.make_lm_head(self.embed_tokens)

    def make_layer(self, layer_index: int, sliding_window: int | None, rotary: RotaryEmbedding) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x
