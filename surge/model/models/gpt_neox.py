"""GPT-NeoX (GPTNeoXForCausalLM; Pythia, the RedPajama-INCITE and Dolly bases): LayerNorms (bias), partial rotary
(rotary_pct, which transformers normalizes to the rope parameters' partial_rotary_factor), a plain MLP with bias,
biases on attention when attention_bias, and the parallel residual with two norms (use_parallel_residual) or the
pre-norm one. The checkpoint fuses q/k/v per head: query_key_value's rows are [q_h | k_h | v_h] for each head h."""
from __future__ import annotations

import torch
from torch import nn

from surge.model.arch import ShardId, cfg_get
from surge.model.layers.linear import QKVParallelLinear
from surge.model.layers.rotary import RotaryEmbedding
from surge.model.models.layernorm_decoder import LayerNormCausalLM, ParallelResidualLayer, PlainMLP, PreNormLayer
from surge.model.models.llama import DecoderAttention

PER_HEAD = "per_head"  # the shard id of a q/k/v tensor fused head by head


class PerHeadFusedQKV(QKVParallelLinear):
    """Takes, besides q/k/v shards, GPT-NeoX's fused tensor [heads * (q_h | k_h | v_h), ...]."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id != PER_HEAD:
            return super().weight_loader(param, loaded, shard_id)
        heads, d = self.total_num_heads, self.head_dim
        if self.total_num_kv_heads != heads or loaded.shape[0] != 3 * heads * d:
            raise ValueError(f"fused query_key_value of shape {tuple(loaded.shape)} is not {heads} heads of "
                             f"3 x {d} rows")
        per_head = loaded.reshape(heads, 3, d, *loaded.shape[1:])
        for i, part in enumerate(("q", "k", "v")):
            super().weight_loader(param, per_head[:, i].reshape(heads * d, *loaded.shape[1:]), part)


class GPTNeoXForCausalLM(LayerNormCausalLM):
    weight_mapper = LayerNormCausalLM.weight_mapper.extend(
        prefixes=(("gpt_neox.", ""), ("embed_out.", "lm_head.")),
        renames=((r"^embed_in\.", "embed_tokens."), (r"\.attention\.", ".self_attn."),
                 (r"\.self_attn\.dense\.", ".self_attn.o_proj."), (r"\.mlp\.dense_h_to_4h\.", ".mlp.fc1."),
                 (r"\.mlp\.dense_4h_to_h\.", ".mlp.fc2."), (r"^final_layer_norm\.", "norm.")),
        skip=(r"\.attention\.(masked_)?bias$",),  # older checkpoints' causal-mask buffers
        packed={"query_key_value": ("qkv_proj", PER_HEAD)})

    def make_layer(self, layer_index: int, sliding_window: int | None, rotary: RotaryEmbedding) -> nn.Module:
        tc, hidden = self.tc, self.tc.hidden_size
        bias = bool(cfg_get(tc, "attention_bias", True))
        attn = DecoderAttention(tc, sliding_window, rotary, qkv_bias=bias, o_bias=bias)
        qkv = attn.qkv_proj  # the same projection, with a loader that also reads the per-head fused layout
        attn.qkv_proj = PerHeadFusedQKV(hidden, qkv.head_dim, qkv.total_num_heads, qkv.total_num_kv_heads, bias)
        mlp = PlainMLP(hidden, tc.intermediate_size, True, cfg_get(tc, "hidden_act", "gelu"))
        if cfg_get(tc, "use_parallel_residual", True):
            return ParallelResidualLayer(hidden, self.eps, attn, mlp, shared_norm=False)
        return PreNormLayer(hidden, self.eps, attn, mlp)
