"""StarCoder2 (Starcoder2ForCausalLM): a pre-norm decoder with LayerNorms (bias), biases on every projection when
use_bias, a plain (not gated) MLP c_fc / c_proj, and a sliding window on every layer when the config sets one."""
from __future__ import annotations

from torch import nn

from surge.model.arch import cfg_get
from surge.model.layers.rotary import RotaryEmbedding
from surge.model.models.layernorm_decoder import LayerNormCausalLM, PlainMLP, PreNormLayer
from surge.model.models.llama import DecoderAttention


class Starcoder2ForCausalLM(LayerNormCausalLM):
    eps_field = "norm_epsilon"
    weight_mapper = LayerNormCausalLM.weight_mapper.extend(renames=((r"\.mlp\.c_fc\.", ".mlp.fc1."),
                                                                    (r"\.mlp\.c_proj\.", ".mlp.fc2.")))

    def make_layer(self, layer_index: int, sliding_window: int | None, rotary: RotaryEmbedding) -> nn.Module:
        tc = self.tc
        bias = bool(cfg_get(tc, "use_bias", True))
        attn = DecoderAttention(tc, sliding_window, rotary, qkv_bias=bias, o_bias=bias)
        mlp = PlainMLP(tc.hidden_size, tc.intermediate_size, bias, cfg_get(tc, "hidden_act", "gelu_pytorch_tanh"))
        return PreNormLayer(tc.hidden_size, self.eps, attn, mlp)
