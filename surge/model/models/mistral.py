"""Mistral: the Llama decoder with a sliding window on every layer when config.sliding_window is set.

Mistral configs carry no layer_types: ModelConfig derives them as HF does (every layer slides when sliding_window is
set, none when it is null), and LlamaForCausalLM gives each sliding layer the window. Nothing else differs.
"""
from __future__ import annotations

from surge.model.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
