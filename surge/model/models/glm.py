"""GLM (`GlmForCausalLM`, e.g. glm-4-9b-chat-hf) and GLM-4 (`Glm4ForCausalLM`, the GLM-4-0414 models): Llama's
decoder with q/k/v biases (attention_bias; o_proj has none), rope on the first partial_rotary_factor of each head in
GPT-J's interleaved layout, and the MLP's gate and up projections fused in one checkpoint tensor (gate_up_proj, gate
rows first).

GLM-4 adds a norm after each block (post_self_attn_layernorm, post_mlp_layernorm) to the pre-norms.
"""
from __future__ import annotations

from torch import nn

from surge.model.arch import cfg_get, head_dim
from surge.model.layers.norm import RMSNorm
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters
from surge.model.models.llama import DecoderAttention, LlamaForCausalLM


class SandwichDecoderLayer(nn.Module):
    """GLM-4's layer: h = h + post_self_attn_layernorm(attn(input_layernorm(h)));
    h = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_self_attn_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_mlp_layernorm = RMSNorm(hidden, eps)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(positions, x, meta))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual


class GlmForCausalLM(LlamaForCausalLM):
    # The checkpoint's mlp.gate_up_proj is already [gate | up]: it loads whole (shard id None) into the merged layer.

    def make_rotary(self, layer_type: str) -> RotaryEmbedding:
        # rotary_dim: head_dim x rope_parameters' partial_rotary_factor (GLM's configs default it to 0.5)
        return RotaryEmbedding(head_dim(self.tc), self.config.max_model_len, rope_parameters(self.tc, layer_type),
                               interleaved=True)

    def make_attention(self, layer_index, sliding_window, rotary) -> nn.Module:
        return DecoderAttention(self.tc, sliding_window, rotary, qkv_bias=bool(cfg_get(self.tc, "attention_bias",
                                                                                        False)))


class Glm4ForCausalLM(GlmForCausalLM):
    def __init__(self, config, quant_config=None) -> None:
        super().__init__(config, quant_config)
        eps = cfg_get(self.tc, "rms_norm_eps", 1e-6)
        self.layers = nn.ModuleList(SandwichDecoderLayer(self.tc.hidden_size, eps, layer.self_attn, layer.mlp)
                                    for layer in self.layers)
