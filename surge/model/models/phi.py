"""Phi-2 (PhiForCausalLM): one LayerNorm per layer feeding attention and MLP in parallel, partial rotary, biases on
q/k/v, the output projection, the plain (gelu_new) MLP, the final LayerNorm and the LM head; optional LayerNorm on
the query and key heads (qk_layernorm)."""
from __future__ import annotations

from torch import nn

from surge.model.arch import cfg_get, head_dim
from surge.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from surge.model.layers.norm import LayerNorm
from surge.model.layers.rotary import RotaryEmbedding
from surge.model.models.layernorm_decoder import (LayerNormCausalLM, ParallelResidualLayer, PlainMLP,
                                                  QKNormAttention)
from surge.model.models.llama import DecoderAttention


class PhiForCausalLM(LayerNormCausalLM):
    weight_mapper = LayerNormCausalLM.weight_mapper.extend(
        renames=((r"\.self_attn\.dense\.", ".self_attn.o_proj."), (r"^final_layernorm\.", "norm.")))

    def make_layer(self, layer_index: int, sliding_window: int | None, rotary: RotaryEmbedding) -> nn.Module:
        tc, d = self.tc, head_dim(self.tc)
        if cfg_get(tc, "qk_layernorm", False):  # one LayerNorm (with bias) shared by every head
            attn = QKNormAttention(tc, sliding_window, rotary, lambda first, count: LayerNorm(d, self.eps),
                                   qkv_bias=True, o_bias=True)
        else:
            attn = DecoderAttention(tc, sliding_window, rotary, qkv_bias=True, o_bias=True)
        mlp = PlainMLP(tc.hidden_size, tc.intermediate_size, True, cfg_get(tc, "hidden_act", "gelu_new"))
        return ParallelResidualLayer(tc.hidden_size, self.eps, attn, mlp, shared_norm=True)

    def make_lm_head(self, embed: VocabParallelEmbedding) -> ParallelLMHead:
        head = ParallelLMHead(self.tc.vocab_size, self.tc.hidden_size, bias=True)
        if self.tie_word_embeddings:
            head.weight = embed.weight
        return head
