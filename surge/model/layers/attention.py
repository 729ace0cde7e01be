"""Attention layer: binds one decoder layer to its KV cache tensor and its group, and calls the backend."""
from __future__ import annotations

import torch
from torch import nn

from surge.attention.backend import AttentionBackend, AttentionMetadata, Prologue


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5
        # Bound by the model runner once the KV cache is allocated.
        self.kv_cache: torch.Tensor | None = None
        self.group_id = 0
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: list[AttentionMetadata],
                prologue: Prologue | None = None) -> torch.Tensor:
        """meta: one per KV cache group; this layer reads its own group's."""
        return self.backend.forward(q, k, v, self.kv_cache, meta[self.group_id], self.sliding_window, self.scale,
                                    prologue)
