"""Gemma, Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's (1 + w) RMSNorm computed in float32, embeddings
scaled by sqrt(hidden_size), a gated GELU-tanh MLP and a tied LM head.

Gemma 2 adds sandwich norms (the attention's and the MLP's outputs are normed before their residual add), a softmax
scale of query_pre_attn_scalar ** -0.5, attention- and final-logit soft-capping, and alternating sliding/full layers
(config.layer_types). Gemma 3 drops the soft-capping (HF 5.24 applies only the final one, when set) and adds per-head
q/k norms with the (1 + w) offset, and rope parameters per layer type. The math follows transformers 5.24's
modeling_gemma{,2,3}.py.
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from surge.attention.backend import AttentionMetadata, Prologue
from surge.model.arch import CausalLM, cfg_get, head_dim, refuse
from surge.model.layers.embedding import VocabParallelEmbedding
from surge.model.layers.norm import GemmaRMSNorm
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters
from surge.model.models.llama import MLP, DecoderAttention


@lru_cache
def _embed_scale(hidden: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) as HF multiplies by it: a float32 tensor cast to the embedding's dtype (55.4256 -> 55.5 in
    bfloat16 for Gemma 7B's 3072), exact as a Python float."""
    return torch.tensor(hidden ** 0.5, dtype=torch.float32).to(dtype).item()


class GemmaAttention(DecoderAttention):
    """DecoderAttention whose per-head q/k norms (Gemma 3) are Gemma norms: they run here, before the prologue, which
    only rotates (the fused prologue's norm has no (1 + w) offset)."""

    def __init__(self, tc, sliding_window: int | None, rotary: RotaryEmbedding, *, qk_norm: bool, **kwargs) -> None:
        super().__init__(tc, sliding_window, rotary, **kwargs)
        eps = cfg_get(tc, "rms_norm_eps", 1e-6)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, eps) if qk_norm else None

    def prologue(self, positions: torch.Tensor) -> Prologue:
        rotary = self.rotary
        return Prologue(positions, rotary.cos_cache, rotary.sin_cache, interleaved=rotary.interleaved)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, meta, self.prologue(positions))
        return self.o_proj(out.flatten(1))


class GemmaDecoderLayer(nn.Module):
    """Gemma: Llama's pre-norm layer. Gemma 2/3 (`sandwich`): the attention's and the MLP's outputs are normed too,
    before their residual adds. Carries (x, residual) as Llama's layers do: the hidden state is x + residual."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module, sandwich: bool) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.sandwich = sandwich
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        if sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        if not self.sandwich:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(CausalLM):
    sandwich_norms = False  # Gemma 2/3: four norms per layer
    qk_norm = False  # Gemma 3
    act_field = "hidden_act"  # Gemma 2/3 name it hidden_activation
    attn_softcap_field: str | None = None  # Gemma 2: attn_logit_softcapping
    scale_field: str | None = None  # Gemma 2/3: query_pre_attn_scalar
    final_softcap_field: str | None = None  # Gemma 2/3: final_logit_softcapping

    def __init__(self, config, quant_config=None) -> None:
        super().__init__(config, quant_config)
        tc = self.tc
        if cfg_get(tc, "use_bidirectional_attention", False):
            raise refuse("use_bidirectional_attention", tc.use_bidirectional_attention, "False, None (causal)")
        hidden, eps = tc.hidden_size, cfg_get(tc, "rms_norm_eps", 1e-6)
        self.embed_tokens = VocabParallelEmbedding(tc.vocab_size, hidden)
        self.final_logit_softcap = cfg_get(tc, self.final_softcap_field) if self.final_softcap_field else None
        rotaries: dict[str, RotaryEmbedding] = {}
        layers = []
        for layer_type in config.layer_types:
            if layer_type not in rotaries:  # Gemma 3: rope parameters per layer type
                rotaries[layer_type] = RotaryEmbedding(head_dim(tc), config.max_model_len,
                                                       rope_parameters(tc, layer_type))
            window = config.sliding_window if layer_type == "sliding_attention" else None
            mlp = MLP(hidden, tc.intermediate_size, act=cfg_get(tc, self.act_field, "gelu_pytorch_tanh"),
                      act_field=self.act_field)
            layers.append(GemmaDecoderLayer(hidden, eps, self.make_attention(window, rotaries[layer_type]), mlp,
                                            self.sandwich_norms))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(hidden, eps)
        self.lm_head = self.make_lm_head(self.embed_tokens)

    def make_attention(self, sliding_window: int | None, rotary: RotaryEmbedding) -> GemmaAttention:
        tc = self.tc
        bias = bool(cfg_get(tc, "attention_bias", False))  # on q, k, v and o
        scale = getattr(tc, self.scale_field) ** -0.5 if self.scale_field else None
        softcap = cfg_get(tc, self.attn_softcap_field) if self.attn_softcap_field else None
        return GemmaAttention(tc, sliding_window, rotary, qk_norm=self.qk_norm, qkv_bias=bias, o_bias=bias,
                              scale=scale, logit_softcap=softcap)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids' embeddings, scaled by sqrt(hidden_size) as the decoder takes them (a VLM merges its images'
        rows, unscaled, into these)."""
        x = self.embed_tokens(input_ids)
        return x * _embed_scale(self.tc.hidden_size, x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(GemmaForCausalLM):
    sandwich_norms = True
    act_field = "hidden_activation"
    attn_softcap_field = "attn_logit_softcapping"
    scale_field = "query_pre_attn_scalar"
    final_softcap_field = "final_logit_softcapping"


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    # HF 5.24's Gemma3Attention does not pass attn_logit_softcapping to the attention: it changes nothing there.
    attn_softcap_field = None
    qk_norm = True
