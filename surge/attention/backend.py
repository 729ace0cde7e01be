"""The attention-backend interface: a backend owns its KV cache layout (`kv_cache_shape`), builds its metadata
per KV cache group from what the runner computes once per step, warms up its kernels, and says how CUDA graphs use
it. Backends register by name; the CPU backend is plain torch, the GPU one (Triton) plugs in the same way.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from surge.core.kv_cache.spec import KVCacheSpec
from surge.kernels.reference import rms_norm, rotate


@dataclass
class CommonAttentionMetadata:
    """What every KV cache group shares in one step: the batch's layout, host and device copies."""
    num_reqs: int
    num_tokens: int
    query_start_loc: list[int]  # [num_reqs + 1], on the host
    seq_lens: list[int]  # tokens in the cache for each request after this step
    max_query_len: int
    max_seq_len: int
    query_start_loc_t: torch.Tensor  # device copies, for batched kernels
    seq_lens_t: torch.Tensor


@dataclass
class AttentionMetadata(CommonAttentionMetadata):
    """One KV cache group's view of the step: the common layout plus its own slots and block tables."""
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, padded with the null block
    # [num_tokens] int32, for layers with params.bidirectional_spans, only in steps that compute image tokens: a
    # query sees keys up to max(its position, causal_end): an image token's is the last position of its image, so
    # the image's tokens see each other both ways (Gemma 3); a text token's is 0. None: every query is causal.
    causal_end: torch.Tensor | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class AttentionParams:
    """One attention layer as the kernels see it, bound when the layer is built (per rank: this rank's heads).
    Layers with equal params share compiled kernel variants; the set of distinct params is what warm-up compiles."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale (head_dim ** -0.5 unless the model says otherwise)
    sliding_window: int | None = None  # a query sees itself and the sliding_window - 1 positions before it
    logit_softcap: float | None = None  # scores s -> cap * tanh(s / cap) before masking (Gemma 2)
    has_sinks: bool = False  # a learned logit per query head joins each softmax's denominator (gpt-oss)
    causal: bool = True
    # A query inside an image's placeholder span also sees the span's later tokens (meta.causal_end): Gemma 3's
    # bidirectional attention over each image. The scheduler then never ends a chunk inside an image.
    bidirectional_spans: bool = False
    head_dim_v: int | None = None  # values' head size where it differs from keys' (MLA); None: head_dim
    # Multi-head latent attention (DeepSeek V2/V3): keys and values are per-head projections of a cached latent of
    # kv_lora_rank values plus a rotated key of qk_rope_head_dim values shared by every head (the last channels of
    # each query/key head); num_kv_heads is 1, the latent's. None: standard attention.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    # The layer attends in its model's code, outside the backends' forward (DeepSeek V4's sparse attention over
    # compressed entries): in plain torch from the step's host lengths (no kernel variant to compile, no CUDA graph
    # capture), unless device_path and the backend runs the model's kernels (deepseek_v4_kernels), whose batched path
    # reads device lengths only, so its steps may be captured.
    host_path: bool = False
    device_path: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be a positive integer")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap={self.logit_softcap} must be positive")
        if not self.causal:
            raise ValueError("non-causal attention is not supported by the paged backends yet")
        if self.is_mla:
            if self.num_kv_heads != 1 or not 0 < self.qk_rope_head_dim < self.head_dim or self.head_dim_v is None:
                raise ValueError(f"an MLA layer has one latent KV head, 0 < qk_rope_head_dim < head_dim and a "
                                 f"head_dim_v: got num_kv_heads={self.num_kv_heads}, qk_rope_head_dim="
                                 f"{self.qk_rope_head_dim}, head_dim={self.head_dim}, head_dim_v={self.head_dim_v}")
            if (self.sliding_window is not None or self.logit_softcap is not None or self.has_sinks
                    or self.bidirectional_spans):
                raise ValueError("an MLA layer with a sliding window, soft-capping, sinks or bidirectional spans is "
                                 "not supported")
        elif self.head_dim_v not in (None, self.head_dim):
            raise ValueError(f"head_dim_v={self.head_dim_v} differs from head_dim={self.head_dim}: only MLA layers "
                             "support that")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def torch_path(self) -> bool:
        """Attends in plain torch whatever the backend (MLA's forward_mla, or a host-path layer)."""
        return self.is_mla or self.host_path


@dataclass
class Prologue:
    """What q and k go through before the cache write: optional per-head RMSNorm (Qwen3), then rotary embedding
    over the first `rotary_dim` channels of each head (all of them by default), in the NeoX layout (halves rotated
    against each other) or, `interleaved`, GPT-J's (pairs of neighbours). Plain tensors, so a backend may fuse it
    with the write; `apply` is the unfused reference."""
    positions: torch.Tensor  # [T]
    cos_cache: torch.Tensor  # [max_position, rotary_dim // 2] float32
    sin_cache: torch.Tensor
    q_norm_weight: torch.Tensor | None = None  # RMSNorm over head_dim
    k_norm_weight: torch.Tensor | None = None
    norm_eps: float = 0.0
    interleaved: bool = False

    @property
    def rotary_dim(self) -> int:
        return 2 * self.cos_cache.shape[-1]

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm_weight is not None:
            q, k = rms_norm(q, self.q_norm_weight, self.norm_eps), rms_norm(k, self.k_norm_weight, self.norm_eps)
        cos = self.cos_cache[self.positions].unsqueeze(1)
        sin = self.sin_cache[self.positions].unsqueeze(1)
        # q and k side by side through one rotation: half the small ops, which dominate at decode batch sizes.
        qk = torch.cat((q, k), dim=1)
        rot = self.rotary_dim
        if rot == qk.shape[-1]:
            qk = rotate(qk, cos, sin, self.interleaved)
        else:  # partial rotary: the remaining channels pass through
            qk = torch.cat((rotate(qk[..., :rot], cos, sin, self.interleaved), qk[..., rot:]), dim=-1)
        return qk[:, :q.shape[1]], qk[:, q.shape[1]:]


class AttentionBackend(ABC):
    name: str
    # Decode steps may be captured in CUDA graphs: the backend reads every live length from device tensors.
    supports_cuda_graphs = False

    def kv_cache_shape(self, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
        """The shape of one layer's cache tensor: the spec's layout ([planes, num_blocks, block_size, heads, dim])."""
        return spec.cache_shape(num_blocks)

    def build_metadata(self, common: CommonAttentionMetadata, slot_mapping: torch.Tensor,
                       block_table: torch.Tensor) -> AttentionMetadata:
        """One group's metadata for a step."""
        return AttentionMetadata(**vars(common), slot_mapping=slot_mapping, block_table=block_table)

    def build_for_graph_capture(self, common: CommonAttentionMetadata, slot_mapping: torch.Tensor,
                                block_table: torch.Tensor) -> AttentionMetadata:
        """Metadata a CUDA graph captures: shaped by capacity, so every replay reuses it."""
        return self.build_metadata(common, slot_mapping, block_table)

    def warm_up(self, device: torch.device, layers: tuple[AttentionParams, ...], block_size: int, dtype: torch.dtype,
                decode_sizes: list[int], max_num_seqs: int, max_workers: int,
                kv_cache_dtype: torch.dtype | None = None) -> int:
        """Compile the kernel variants the runtime will dispatch (kv_cache_dtype: the cache's, None: dtype);
        returns how many were compiled."""
        return 0

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, params: AttentionParams, prologue: Prologue | None = None,
                sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: `kv_cache_shape(...)`, in q's dtype or float8_e4m3fn (an FP8
        cache: k_scale, v_scale are float32 scalar tensors, a stored x stands for x * scale; ignored otherwise);
        meta: the layer's group's; sinks: [Hq] float32 when params.has_sinks. Applies the prologue to q and k, writes
        k, v at meta.slot_mapping (quantized for an FP8 cache, and then every key and value attended to, this step's
        too, is the stored one); returns [T, Hq, D]. A query at position p attends to positions <= p (<=
        max(p, meta.causal_end[t]) with params.bidirectional_spans), and with a sliding window only to positions
        > p - sliding_window."""


    def forward_mla(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, params: AttentionParams, kv_b_weight: torch.Tensor) -> torch.Tensor:
        """Multi-head latent attention (params.is_mla). q: [T, H, nope + rope], its rope channels rotated; kv_c:
        [T, kv_lora_rank], the normed latent; k_pe: [T, rope], rotated; kv_cache: an MLAAttentionSpec's layout;
        kv_b_weight: [H * (nope + head_dim_v), kv_lora_rank], this rank's heads of kv_b_proj. Writes [kv_c | k_pe]
        at meta.slot_mapping; returns [T, H, head_dim_v]. Plain torch here (surge/attention/mla.py); the Triton backend
        runs its kernel."""
        from surge.attention.mla import mla_forward
        return mla_forward(q, kv_c, k_pe, kv_cache, meta, params, kv_b_weight)

    def deepseek_v4_kernels(self, device: torch.device):
        """The DeepSeek V4 layers' kernels (surge/attention/deepseek_v4_triton.DeepseekV4Kernels) on this backend, or
        None: they attend on their host path in plain torch (surge/attention/deepseek_v4.py), as here."""
        return None

    def supports_cuda_graphs_for(self, layers: tuple[AttentionParams, ...]) -> bool:
        """Whether steps of a model with these layers may be captured: the torch paths (MLA's, host-path layers) read
        host lengths (a backend whose MLA path reads them on the device says so)."""
        return self.supports_cuda_graphs and not any(p.torch_path for p in layers)


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
