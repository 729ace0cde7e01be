"""The attention-backend interface: per-step metadata built once by the model runner, and a backend that
writes new keys/values into the paged cache and attends over each request's blocks.

Backends register by name; the CPU backend is plain torch, the GPU one (Triton) plugs in the same way.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int
    query_start_loc: list[int]  # [num_reqs + 1], on the host
    seq_lens: list[int]  # tokens in the cache for each request after this step
    max_query_len: int
    max_seq_len: int
    # Per KV cache group:
    slot_mapping: list[torch.Tensor]  # [num_tokens] int64: block_id * block_size + offset of each new token
    block_tables: list[torch.Tensor]  # [num_reqs, max_blocks] int32, padded with the null block
    # Device copies, for batched kernels:
    query_start_loc_t: torch.Tensor
    seq_lens_t: torch.Tensor


@dataclass
class Prologue:
    """What q and k go through before the cache write: optional per-head RMSNorm (Qwen3), then rotary embedding.
    A backend may fuse it with the write; `apply` is the unfused reference."""
    positions: torch.Tensor  # [T]
    rotary: nn.Module  # RotaryEmbedding: (positions, q, k) -> (q, k), with cos_cache / sin_cache buffers
    q_norm: nn.Module | None = None  # RMSNorm over head_dim (weight, eps)
    k_norm: nn.Module | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary(self.positions, q, k)


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, group_id: int, sliding_window: int | None, scale: float,
                prologue: Prologue | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D].
        Applies the prologue to q and k, writes k, v at meta.slot_mapping[group_id]; returns [T, Hq, D]. A query at
        position p attends to positions <= p, and with a sliding window only to positions > p - sliding_window."""


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; available: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()


def default_backend_name(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"
