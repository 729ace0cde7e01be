"""SmolLM3: the Llama decoder with rope skipped on some layers (NoPE): config.no_rope_layers[i] is 1 where layer i
uses rope, 0 where it does not (HF derives it from no_rope_layer_interval when absent: every interval-th layer skips).
"""
from __future__ import annotations

from torch import nn

from surge.model.arch import cfg_get
from surge.model.layers.rotary import RotaryEmbedding
from surge.model.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, layer_index: int, sliding_window: int | None,
                       rotary: RotaryEmbedding | None) -> nn.Module:
        uses_rope = cfg_get(self.tc, "no_rope_layers")
        if uses_rope is None or len(uses_rope) != self.tc.num_hidden_layers or set(uses_rope) - {0, 1}:
            raise ValueError(f"config field no_rope_layers={uses_rope!r} must list 0 or 1 for each of the "
                             f"{self.tc.num_hidden_layers} layers")
        return super().make_attention(layer_index, sliding_window, rotary if uses_rope[layer_index] else None)
