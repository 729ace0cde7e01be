"""Attention layer: one decoder layer's attention parameters (bound at construction), its KV cache spec, and, once
the runner allocates the cache, its cache tensor and group; forward calls the backend.

An FP8 KV cache reads the layer's per-tensor `k_scale` and `v_scale` (vLLM's names: `...self_attn.attn.k_scale`):
float32 buffers, 1.0 unless the checkpoint has them; a cache of the model's dtype ignores them, as vLLM does."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from surge.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams, Prologue
from surge.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, SlidingWindowSpec


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None, *,
                 scale: float | None = None, logit_softcap: float | None = None, has_sinks: bool = False) -> None:
        """num_heads, num_kv_heads: this rank's. has_sinks: a learned per-head logit, the `sinks` parameter."""
        super().__init__()
        self.params = AttentionParams(num_heads, num_kv_heads, head_dim,
                                      head_dim ** -0.5 if scale is None else float(scale), sliding_window,
                                      logit_softcap, has_sinks)
        self.sinks = (nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False) if has_sinks
                      else None)
        for name in ("k_scale", "v_scale"):  # optional checkpoint tensors: the loader fills them when present
            self.register_buffer(name, torch.ones((), dtype=torch.float32))
            getattr(self, name).weight_loader = load_kv_scale
        # Bound by the model runner once the KV cache is allocated.
        self.kv_cache: torch.Tensor | None = None
        self.group_id = 0
        self.backend: AttentionBackend | None = None

    @property
    def num_heads(self) -> int:
        return self.params.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.params.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.params.head_dim

    @property
    def sliding_window(self) -> int | None:
        return self.params.sliding_window

    @property
    def scale(self) -> float:
        return self.params.scale

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """What one block of this layer's cache holds; layers with equal specs share a KV cache group."""
        p = self.params
        if p.sliding_window is not None:
            return SlidingWindowSpec(block_size, p.num_kv_heads, p.head_dim, dtype, sliding_window=p.sliding_window)
        return FullAttentionSpec(block_size, p.num_kv_heads, p.head_dim, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: list[AttentionMetadata],
                prologue: Prologue | None = None) -> torch.Tensor:
        """meta: one per KV cache group; this layer reads its own group's."""
        return self.backend.forward(q, k, v, self.kv_cache, meta[self.group_id], self.params, prologue, self.sinks,
                                    self.k_scale, self.v_scale)


class MLAAttention(Attention):
    """Multi-head latent attention (DeepSeek V2/V3) over a latent KV cache (MLAAttentionSpec): per token one row of
    the normed latent and the rotated rope key; the backend's forward_mla expands or absorbs kv_b_proj."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float) -> None:
        """num_heads: this rank's."""
        super().__init__(num_heads, 1, qk_nope_head_dim + qk_rope_head_dim, scale=scale)
        self.params = dataclasses.replace(self.params, head_dim_v=v_head_dim, kv_lora_rank=kv_lora_rank,
                                          qk_rope_head_dim=qk_rope_head_dim)

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if not dtype.is_floating_point or dtype.itemsize == 1:
            raise ValueError(f"kv_cache_dtype={str(dtype).removeprefix('torch.')} is not supported for MLA layers "
                             "yet; use kv_cache_dtype='auto'")
        p = self.params
        return MLAAttentionSpec(block_size, 1, p.kv_lora_rank + p.qk_rope_head_dim, dtype,
                                kv_lora_rank=p.kv_lora_rank)

    def forward(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor,
                meta: list[AttentionMetadata]) -> torch.Tensor:
        """q: [T, H, nope + rope] (rope channels rotated); kv_c: [T, kv_lora_rank] normed; k_pe: [T, rope] rotated;
        kv_b_weight: this rank's kv_b_proj weight. Returns [T, H, v_head_dim]."""
        return self.backend.forward_mla(q, kv_c, k_pe, self.kv_cache, meta[self.group_id], self.params, kv_b_weight)


def load_kv_scale(buffer: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    """A checkpoint's k_scale / v_scale: one positive value for the whole tensor (every rank holds it)."""
    if loaded.numel() != 1:
        raise ValueError(f"a KV cache scale of shape {tuple(loaded.shape)}: only per-tensor scales (one value) are "
                         "supported")
    value = float(loaded.float().reshape(()))
    if not value > 0:
        raise ValueError(f"a KV cache scale of {value}: it must be positive")
    buffer.fill_(value)
