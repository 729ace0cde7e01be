"""DeepSeek V4's attention over its caches through the Triton kernels, the whole batch at once: the CUDA path (and,
under TRITON_INTERPRET=1, testable on the CPU); surge/attention/deepseek_v4.py is the plain-torch host path it
equals, with the same cache layout.

Every token finds its request (the step's query_start_loc on the device) and position, and every length follows
from the position: the windows complete at p are (p + 1) // rate, a window closes at the token whose position is its
last, the sliding window is (p - window, p]. So a step reads no host length and loops over no request: a CUDA graph
captured for a batch's capacity replays for any lengths. Per layer: the token rows written (one index_copy), the
windows closing this step pooled into entries (compressor.py, one program per token, -1 for the tokens that close
nothing), CSA's indexer scoring every complete entry (indexer_score.py, into a buffer as wide as max_model_len //
rate: a capacity, not a live length) and keeping its top-k (indexer_topk.py), then the sparse attention
(sparse_attention.py). Padding tokens of a captured step (slot -1) write into the null block's first row, which no
request reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.attention.backend import AttentionMetadata


@dataclass
class DeepseekV4Kernels:
    """One device's kernel wrappers (each remembers the variants it compiled)."""
    compressor: object  # surge.kernels.compressor.CompressorPool
    scores: object  # surge.kernels.indexer_score.IndexerScores
    topk: object  # surge.kernels.indexer_topk.IndexerTopK
    attention: object  # surge.kernels.sparse_attention.SparseAttention
    mhc: object  # surge.kernels.mhc.MhcPre

    @classmethod
    def on(cls, device: torch.device) -> DeepseekV4Kernels:
        from surge.kernels.compressor import CompressorPool
        from surge.kernels.indexer_score import IndexerScores
        from surge.kernels.indexer_topk import IndexerTopK
        from surge.kernels.mhc import MhcPre
        from surge.kernels.sparse_attention import SparseAttention

        return cls(CompressorPool(device), IndexerScores(device), IndexerTopK(device), SparseAttention(device),
                   MhcPre(device))


@dataclass
class StepTokens:
    """Each token's request row and position, and its token-row slot (padding's clamped into the null block)."""
    req: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64, >= 0
    real: torch.Tensor  # [T] bool: the token belongs to a request (slot >= 0)

    @classmethod
    def of(cls, meta: AttentionMetadata, positions: torch.Tensor) -> StepTokens:
        tokens = positions.shape[0]
        index = torch.arange(tokens, dtype=torch.int32, device=positions.device)
        req = torch.searchsorted(meta.query_start_loc_t[1:], index, right=True)
        req = req.clamp_(max=max(meta.num_reqs - 1, 0)).to(torch.int32)
        slots = meta.slot_mapping[:tokens]
        return cls(req, positions, slots.clamp(min=0), slots >= 0)


def token_rows(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache [1, blocks, rows_per_block, 1, width] as [blocks, rows_per_block, width]."""
    return cache[0, :, :, 0, :]


def write_rows(cache: torch.Tensor, step: StepTokens, row: torch.Tensor) -> None:
    """The step's token rows [T, width] (every column) at their slots."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, step.slots, row)


@dataclass
class ClosingWindows:
    """The compressor's list for a step: per token, the window it closes (its request's row, the window, the entry
    slot), slot -1 where it closes none."""
    seq: torch.Tensor  # [T] int32
    window: torch.Tensor  # [T] int32
    slot: torch.Tensor  # [T] int64

    @classmethod
    def of(cls, step: StepTokens, entry_table: torch.Tensor, rate: int, block_size: int) -> ClosingWindows:
        rows_per_block = max(1, block_size // rate)
        pos = step.positions
        window = torch.div(pos + 1, rate, rounding_mode="floor") - 1
        closes = step.real & ((pos + 1) % rate == 0)
        block = entry_table[step.req.long(), torch.div(pos, block_size, rounding_mode="floor")].long()
        slot = torch.where(closes, block * rows_per_block + window.clamp(min=0) % rows_per_block, -1)
        return cls(step.req, window.clamp(min=0).to(torch.int32), slot)


def pool_windows(kernels: DeepseekV4Kernels, rows: torch.Tensor, entries: torch.Tensor, meta: AttentionMetadata,
                 closing: ClosingWindows, comp, rate: int, overlap: bool) -> None:
    """The entries of the windows closing this step (comp: a WindowCompressor) from the token rows' state."""
    kernels.compressor(rows[..., comp.state_kv], rows[..., comp.state_gate], meta.block_table, comp.position_bias,
                       comp.norm_weight, comp.eps, comp.cos_cache, comp.sin_cache, closing.seq, closing.window,
                       closing.slot, entries[..., comp.entry], rate=rate, overlap=overlap)


def entry_block_table(entry_table: torch.Tensor, rate: int, block_size: int) -> torch.Tensor:
    """The entry group's table by entry block (entry w in block w // rows_per_block, row w % rows_per_block), as
    the indexer's scorer reads it: the table itself when a block holds whole windows, else the column of each
    window's last block."""
    if rate <= block_size:
        return entry_table
    step = rate // block_size
    return entry_table[:, step - 1::step].contiguous()


def select_topk(kernels: DeepseekV4Kernels, index_q: torch.Tensor, index_weights: torch.Tensor,
                index_keys: torch.Tensor, entry_table: torch.Tensor, step: StepTokens, rate: int, block_size: int,
                capacity: int, topk: int) -> torch.Tensor:
    """The indexer's choice per token: [T, topk] int32 entry indices, -1 padded (select_entries' on the host)."""
    num_heads, head_dim = index_q.shape[1], index_q.shape[2]
    complete = torch.div(step.positions + 1, rate, rounding_mode="floor").to(torch.int32)
    scores = kernels.scores(index_q, index_weights, index_keys, entry_block_table(entry_table, rate, block_size),
                            complete, max_len=capacity, softmax_scale=head_dim ** -0.5,
                            weights_scale=num_heads ** -0.5, row_seq=step.req)
    return kernels.topk(scores, complete, topk)
