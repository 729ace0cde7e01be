"""ERNIE 4.5 (dense, `Ernie4_5ForCausalLM`): Llama's decoder with GPT-J's interleaved rope over the whole head, and
use_bias putting a bias on every projection (q, k, v, o and the MLP's); embeddings tied by default."""
from __future__ import annotations

from torch import nn

from surge.model.arch import cfg_get, head_dim
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters
from surge.model.models.llama import MLP, DecoderAttention, LlamaForCausalLM


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    def make_rotary(self, layer_type: str) -> RotaryEmbedding:
        return RotaryEmbedding(head_dim(self.tc), self.config.max_model_len, rope_parameters(self.tc, layer_type),
                               interleaved=True)

    def make_attention(self, layer_index, sliding_window, rotary) -> nn.Module:
        bias = bool(cfg_get(self.tc, "use_bias", False))
        return DecoderAttention(self.tc, sliding_window, rotary, qkv_bias=bias, o_bias=bias)

    def make_mlp(self, layer_index: int) -> nn.Module:
        tc = self.tc
        return MLP(tc.hidden_size, tc.intermediate_size, bool(cfg_get(tc, "use_bias", False)),
                   cfg_get(tc, "hidden_act", "silu"))
