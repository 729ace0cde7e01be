"""Llama-family decoder (Llama, Qwen2, Qwen3, and the families that differ from it only in config): one
implementation, switched by config and by class flags.

Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm; layer_types may mix sliding-window and full attention.
The building blocks (DecoderAttention, MLP, DecoderLayer) are what other families reuse.
"""
from __future__ import annotations

import torch
from torch import nn

from surge.attention.backend import AttentionMetadata, Prologue
from surge.model.arch import CausalLM, cfg_get, head_dim, num_kv_heads
from surge.model.layers.activation import ActAndMul
from surge.model.layers.attention import Attention
from surge.model.layers.embedding import VocabParallelEmbedding
from surge.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from surge.model.layers.norm import RMSNorm
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters
from surge.model.quant.quantized_input import input_quant_of


class DecoderAttention(nn.Module):
    def __init__(self, tc, sliding_window: int | None, rotary: RotaryEmbedding | None, *, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: bool = False, scale: float | None = None,
                 logit_softcap: float | None = None, has_sinks: bool = False, norm_eps: float | None = None) -> None:
        """rotary None: a layer without position embedding (SmolLM3's no-rope layers)."""
        super().__init__()
        hidden, total_heads = tc.hidden_size, tc.num_attention_heads
        self.head_dim = head_dim(tc)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, num_kv_heads(tc), bias=qkv_bias)
        # This rank's heads: all of them with one rank.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shard = self.qkv_proj.shard
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias,
                                        input_shard=(shard.q_start * self.head_dim, shard.q_count * self.head_dim))
        eps = norm_eps if norm_eps is not None else cfg_get(tc, "rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, sliding_window, scale=scale,
                              logit_softcap=logit_softcap, has_sinks=has_sinks)

    @property
    def input_linear(self) -> QKVParallelLinear:
        """The one layer reading forward's x (a subclass reading x otherwise returns None): see
        DecoderLayer.fuse_input_quant."""
        return self.qkv_proj

    def prologue(self, positions: torch.Tensor) -> Prologue | None:
        qn, kn, rotary = self.q_norm, self.k_norm, self.rotary
        if rotary is None:
            return None
        return Prologue(positions, rotary.cos_cache, rotary.sin_cache, qn.weight if qn is not None else None,
                        kn.weight if kn is not None else None, qn.eps if qn is not None else 0.0, rotary.interleaved)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        prologue = self.prologue(positions)
        if prologue is None and self.q_norm is not None:  # no rope, but a q/k norm still applies
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, meta, prologue)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu",
                 act_field: str = "hidden_act") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, {0: intermediate, 1: intermediate}, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        self.act = ActAndMul(act, act_field)

    @property
    def input_linear(self) -> MergedColumnParallelLinear:
        """The one layer reading forward's x."""
        return self.gate_up_proj

    def fuse_input_quant(self) -> None:
        """SiLU-and-mul quantizes its output for an fp8 down projection (surge/model/quant/quantized_input.py)."""
        self.act.output_quant = input_quant_of(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm: attention, then the feed-forward block the model chose for this layer (dense MLP or experts)."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def fuse_input_quant(self) -> None:
        """Once the linear layers have their methods: each RMSNorm quantizes its output in its own kernel where the
        one layer reading it (the block's input_linear) is fp8 with dynamic activations, saving that GEMM's own
        quantization launch (surge/model/quant/quantized_input.py)."""
        for norm, block in ((self.input_layernorm, self.self_attn), (self.post_attention_layernorm, self.mlp)):
            if type(norm) is RMSNorm:  # the norm with the fused kernel (not a subclass's torch norm)
                norm.output_quant = input_quant_of(getattr(block, "input_linear", None))

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config, quant_config=None) -> None:
        super().__init__(config, quant_config)
        tc = self.tc
        hidden = tc.hidden_size
        self.embed_tokens = VocabParallelEmbedding(tc.vocab_size, hidden)
        rotaries: dict[str, RotaryEmbedding] = {}
        layers = []
        for i, layer_type in enumerate(config.layer_types):
            if layer_type not in rotaries:
                rotaries[layer_type] = self.make_rotary(layer_type)
            window = config.sliding_window if layer_type == "sliding_attention" else None
            layers.append(DecoderLayer(hidden, cfg_get(tc, "rms_norm_eps", 1e-6),
                                       self.make_attention(i, window, rotaries[layer_type]), self.make_mlp(i)))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, cfg_get(tc, "rms_norm_eps", 1e-6))
        self.lm_head = self.make_lm_head(self.embed_tokens)

    def make_rotary(self, layer_type: str) -> RotaryEmbedding:
        return RotaryEmbedding(head_dim(self.tc), self.config.max_model_len, rope_parameters(self.tc, layer_type))

    def make_attention(self, layer_index: int, sliding_window: int | None,
                       rotary: RotaryEmbedding | None) -> nn.Module:
        tc = self.tc
        bias = bool(cfg_get(tc, "attention_bias", False))  # Llama: bias on q, k, v and o
        return DecoderAttention(tc, sliding_window, rotary, qkv_bias=self.qkv_bias or bias, o_bias=bias,
                                qk_norm=self.qk_norm)

    def make_mlp(self, layer_index: int) -> nn.Module:
        """The feed-forward block of one layer; mixture-of-experts models choose per layer."""
        tc = self.tc
        return MLP(tc.hidden_size, tc.intermediate_size, bool(cfg_get(tc, "mlp_bias", False)),
                   cfg_get(tc, "hidden_act", "silu"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; `compute_logits` maps the rows that need them to logits.
        inputs_embeds: the rows to run instead of the ids' embeddings (a VLM's, with its images merged in)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
