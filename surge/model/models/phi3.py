"""Phi-3 (Phi3ForCausalLM): Llama's decoder whose checkpoints store q/k/v fused as `qkv_proj` and gate/up as
`gate_up_proj`; the merged layers split such a tensor by their shard sizes (any tensor parallelism). Partial rotary
(rope partial_rotary_factor, Phi-4-mini) and a sliding window on every layer (config sliding_window) come through the
shared config reading. Long-context checkpoints use longrope, which the rotary layer refuses by name until it has it.
"""
from __future__ import annotations

from surge.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """No attention or MLP bias; the fused tensors map to the merged layers with no shard id (split on load)."""
