"""KV cache specs and groups: one group per attention kind, each spec declaring what consumers may do with it.

Consumers select groups by declared capability (`prefix_cacheable`, `transferable`), never by class name. A spec
owns its layer's cache layout: [planes, num_blocks, rows_per_block, heads, head_dim], planes K and V (2) for
standard attention, one for an MLA latent; the block is dimension 1 in every layout, which the KV connectors index.
Every group's block covers block_size token positions (one block table per group, one prefix hash per block); what a
block holds for them is the spec's: a row per token, or a compressed cache's one entry per window of tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def num_planes(self) -> int:
        """Tensors cached per token and head: keys and values."""
        return 2

    @property
    def rows_per_block(self) -> int:
        """Rows a block holds for its block_size token positions: one per token."""
        return self.block_size

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's cache tensor: [planes, num_blocks, rows_per_block, heads, head_dim]."""
        return (self.num_planes, num_blocks, self.rows_per_block, self.num_kv_heads, self.head_dim)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: every plane (keys and values)."""
        return self.num_planes * self.rows_per_block * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def layout_id(self) -> str:
        """What a block's bytes mean (kind, heads, head size, window): connectors exchange blocks only between
        caches whose layout ids are equal."""
        window = getattr(self, "sliding_window", 0)
        return f"{type(self).__name__}:{self.num_kv_heads}x{self.head_dim}:w{window}"

    @property
    def prefix_cacheable(self) -> bool:
        """Blocks hold stable per-position data that a later request with the same prefix may reuse."""
        raise NotImplementedError

    @property
    def transferable(self) -> bool:
        """Blocks may be sent to another instance (prefill -> decode)."""
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    @property
    def prefix_cacheable(self) -> bool:
        return True

    @property
    def transferable(self) -> bool:
        return True


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    sliding_window: int = 0  # a token attends to itself and the sliding_window - 1 tokens before it

    def __post_init__(self) -> None:
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive")

    @property
    def prefix_cacheable(self) -> bool:
        return True

    @property
    def transferable(self) -> bool:
        return True

    def max_live_blocks(self, max_num_seqs: int, max_num_batched_tokens: int, lookback: int) -> int:
        """Blocks the running requests can hold at once, the null block included: each keeps the blocks of its
        window (and of the lookback tokens a step may start earlier: drafts in flight) plus the one it writes, and
        a step's new tokens fill at most max_num_batched_tokens more positions (one straddled block a request).
        Beyond that a pool only keeps evictable prefix-cache blocks, so the group's pool stops there."""
        per_request = -(-(self.sliding_window - 1 + lookback) // self.block_size) + 2
        return max_num_seqs * per_request + -(-max_num_batched_tokens // self.block_size) + 1


@dataclass(frozen=True)
class CompressedEntrySpec(FullAttentionSpec):
    """A compressed cache (DeepSeek V4's CSA and HCA layers): one row of head_dim values per window of compress_rate
    tokens, the entry the window leaves once its last token is computed (and, for CSA, the indexer's key beside it).
    A block covers block_size positions like every group's and holds the entries of the windows ending in it:
    block_size / rate of them, or one when the rate exceeds block_size (a window spans rate / block_size blocks, and
    only the block of its last token holds its row; the others' row stays unused). Full attention for the managers:
    every entry is read by every later query; prefix-cacheable and transferable, as an entry is a function of the
    tokens up to its window's end."""
    compress_rate: int = 0

    def __post_init__(self) -> None:
        rate, bs = self.compress_rate, self.block_size
        if rate <= 0 or (bs % rate and rate % bs):
            raise ValueError(f"a compressed KV cache needs block_size={bs} and compress_rate={rate} to divide one "
                             "another (windows must not straddle a block that holds several entries)")

    @property
    def num_planes(self) -> int:
        return 1

    @property
    def rows_per_block(self) -> int:
        return max(1, self.block_size // self.compress_rate)

    @property
    def layout_id(self) -> str:
        return f"{type(self).__name__}:rate{self.compress_rate}:{self.head_dim}"


@dataclass(frozen=True)
class SlidingTokenRowSpec(SlidingWindowSpec):
    """One plane: per token one row of head_dim values whose columns the layer lays out, blocks that fell out of the
    window going back to the pool (DeepSeek V4's layers: the shared key-value, whose key is its value, and in
    compressed layers the compressor's per-token state, read until the window's entry is made; the window is the
    longer of the attention's and the compressor's)."""

    @property
    def num_planes(self) -> int:
        return 1


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek V2/V3): per token one "head" of the compressed latent (kv_lora_rank
    values) followed by the shared rotated key (qk_rope_head_dim): head_dim = kv_lora_rank + qk_rope_head_dim, one
    plane, no per-head keys or values (every query head expands or absorbs the same latent). The same on every
    tensor-parallel rank: the latent is replicated. Full attention for the managers."""
    kv_lora_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_kv_heads != 1 or not 0 < self.kv_lora_rank < self.head_dim:
            raise ValueError(f"an MLA cache holds one head of kv_lora_rank + qk_rope_head_dim values: got "
                             f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                             f"kv_lora_rank={self.kv_lora_rank}")

    @property
    def num_planes(self) -> int:
        return 1

    @property
    def qk_rope_head_dim(self) -> int:
        return self.head_dim - self.kv_lora_rank

    @property
    def layout_id(self) -> str:
        return f"{type(self).__name__}:latent{self.kv_lora_rank}+rope{self.qk_rope_head_dim}"

    @property
    def prefix_cacheable(self) -> bool:
        return True

    @property
    def transferable(self) -> bool:
        return True


@dataclass(frozen=True)
class KVCacheGroup:
    group_id: int
    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    groups: tuple[KVCacheGroup, ...]
    num_blocks: int  # per group, the null block (id 0) included; a sliding group's capped by its live blocks
    live_block_caps: tuple[int | None, ...] = ()  # per group: its max_live_blocks, None (or empty) uncapped

    def num_blocks_of(self, group_id: int) -> int:
        """The group's pool: num_blocks, or fewer for a sliding group that can never hold more at once."""
        cap = self.live_block_caps[group_id] if self.live_block_caps else None
        return self.num_blocks if cap is None else min(self.num_blocks, cap)

    @property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        return tuple(g.group_id for g in self.groups if g.spec.prefix_cacheable)

    @property
    def transferable_group_ids(self) -> tuple[int, ...]:
        return tuple(g.group_id for g in self.groups if g.spec.transferable)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across every group and layer (caps aside)."""
        return sum(g.spec.page_size_bytes * len(g.layer_ids) for g in self.groups)

    @property
    def total_bytes(self) -> int:
        """Bytes of every group's pool."""
        return sum(g.spec.page_size_bytes * len(g.layer_ids) * self.num_blocks_of(g.group_id) for g in self.groups)

    def group_of_layer(self, layer_id: int) -> KVCacheGroup:
        for g in self.groups:
            if layer_id in g.layer_ids:
                return g
        raise KeyError(layer_id)


def live_block_caps(groups: tuple[KVCacheGroup, ...], max_num_seqs: int, max_num_batched_tokens: int,
                    lookback: int) -> tuple[int | None, ...]:
    """Per group, the most blocks it can hold at once (sliding windows), or None (every block is kept)."""
    return tuple(g.spec.max_live_blocks(max_num_seqs, max_num_batched_tokens, lookback)
                 if isinstance(g.spec, SlidingWindowSpec) else None for g in groups)


def num_blocks_for_budget(groups: tuple[KVCacheGroup, ...], caps: tuple[int | None, ...], budget: int,
                          extra_bytes_per_block: int = 0) -> int:
    """The largest num_blocks (null block included) whose pools fit budget bytes: the capped groups' pools cost a
    fixed amount, the others (and extra_bytes_per_block: a draft model's layers) one page a layer per block. A cap
    above the answer does not bind, so its group joins the per-block cost and the answer is computed again."""
    page = {g.group_id: g.spec.page_size_bytes * len(g.layer_ids) for g in groups}
    capped = {g for g, cap in enumerate(caps) if cap is not None}
    while True:
        fixed = sum(page[g] * caps[g] for g in capped)
        per_block = sum(page[g] for g in page if g not in capped) + extra_bytes_per_block
        num_blocks = max(caps[g] for g in capped) if per_block == 0 else (budget - fixed) // per_block + 1
        binding = {g for g in capped if caps[g] < num_blocks}
        if binding == capped:
            return num_blocks
        capped = binding


def build_kv_cache_groups(layer_specs: list[KVCacheSpec] | tuple[KVCacheSpec, ...]) -> tuple[KVCacheGroup, ...]:
    """One group per distinct spec among the layers (each layer's own, as its attention layer declares it), in order
    of first appearance: full and sliding layers, or two sliding windows, get groups of their own."""
    layers: dict[KVCacheSpec, list[int]] = {}
    for layer_id, spec in enumerate(layer_specs):
        layers.setdefault(spec, []).append(layer_id)
    return tuple(KVCacheGroup(i, spec, tuple(ids)) for i, (spec, ids) in enumerate(layers.items()))
