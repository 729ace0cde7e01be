"""gpt-oss: a decoder whose layers alternate sliding-window and full attention (config.layer_types), with q/k/v/o
biases and a learned sink logit per head, and whose every feed-forward block is a mixture of experts: a router with
a bias (the top k logits, then their softmax) and experts with biases and a clamped SwiGLU.

Checkpoints in HF transformers' layout, bf16 or float32: stacked experts [E, in, out] with gate and up interleaved;
or the released MXFP4 experts (surge/model/quant/mxfp4.py), [E, out, in / 32] blocks.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from surge.model.arch import cfg_get
from surge.model.layers.moe import SparseMoeBlock
from surge.model.layers.rotary import RotaryEmbedding
from surge.model.models.llama import DecoderAttention, LlamaForCausalLM

# model.layers.N.mlp.experts.{gate_up,down}_proj[_bias]: every expert stacked (HF transformers' names and layout);
# MXFP4 checkpoints hold {gate_up,down}_proj_blocks and _scales instead of the weights.
_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up|down)_proj(?P<suffix>_bias|_blocks|_scales)?$")


def _sinks_loader(first_head: int):
    """The checkpoint's sinks [num_attention_heads] -> this rank's heads [first_head, first_head + local)."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dim() != 1 or loaded.shape[0] < first_head + param.shape[0]:
            raise ValueError(f"sinks of shape {tuple(loaded.shape)} do not cover heads "
                             f"[{first_head}, {first_head + param.shape[0]})")
        param.data.copy_(loaded.narrow(0, first_head, param.shape[0]))
    return load


class GptOssForCausalLM(LlamaForCausalLM):
    weight_mapper = LlamaForCausalLM.weight_mapper.extend(
        renames=((r"\.self_attn\.sinks$", ".self_attn.attn.sinks"), (r"\.mlp\.router\.", ".mlp.gate.")))

    def make_attention(self, layer_index: int, sliding_window: int | None,
                       rotary: RotaryEmbedding | None) -> nn.Module:
        bias = bool(cfg_get(self.tc, "attention_bias", True))
        attention = DecoderAttention(self.tc, sliding_window, rotary, qkv_bias=bias, o_bias=bias, has_sinks=True)
        attention.attn.sinks.weight_loader = _sinks_loader(attention.qkv_proj.shard.q_start)
        return attention

    def make_mlp(self, layer_index: int) -> nn.Module:
        tc = self.tc
        # HF's experts ignore hidden_act: the clamped SwiGLU is theirs whatever the config says.
        return SparseMoeBlock(tc.hidden_size, tc.num_local_experts, tc.num_experts_per_tok, tc.intermediate_size,
                              norm_topk_prob=False, router_bias=True, softmax_after_topk=True, bias=True,
                              activation="swiglu_oai", swiglu_alpha=cfg_get(tc, "swiglu_alpha", 1.702),
                              swiglu_limit=cfg_get(tc, "swiglu_limit", 7.0), stacked_in_out=True,
                              interleaved_gate_up=True)

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        m = _EXPERTS.match(name.removeprefix("model."))
        if m is None:
            return super().checkpoint_name_to_param(name)
        return f"{m['prefix']}.{m['proj']}_proj{m['suffix'] or ''}", (m["proj"], None)
