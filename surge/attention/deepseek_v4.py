"""DeepSeek V4's attention in plain torch over its caches, request by request from the step's host lengths: the torch
backend's path (the CPU's), and the reference of the batched Triton path (surge/attention/deepseek_v4_triton.py).

Two caches per compressed layer, one for a sliding layer:
- token rows (SlidingTokenRowSpec), one per token position, kept while a later token reads them: `kv`, the token's
  shared key-value (normed, rotated), read by the sliding window; in compressed layers `state_kv`, `state_gate`, the
  compressor's projections of the token (2 x head_dim wide with CSA's overlapping windows), the inputs of the entry
  its window will make, and `index_kv`, `index_gate` for the lightning indexer's own compressor (CSA). The group's
  window is the longer of the attention's and the compressor's (rate tokens, 2 x rate with CSA's overlap), so the
  partial window not yet compressed lives in the token rows of the last window only;
- entry rows (CompressedEntrySpec), one per window of rate tokens: `entry`, the compressed entry the window leaves
  (written the step its last token is computed, when every token of the window, and of the window before it, has
  its state rows), and `index_entry`, the indexer's key (CSA). Every entry is kept.
Each row is a function of the tokens up to its position (or its window's end), so prefix-cache hits, chunked prefill
and preemption's recomputation are exact by construction.

A query at position t attends to the keys at (t - sliding_window, t], to the compressed entries of the windows
complete at t (w < (t + 1) // rate): all of them (HCA), or the index_topk the indexer scores highest among them
(CSA, ties to the lower index), plus a learned sink per head in the softmax's denominator. K = V.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.attention.backend import AttentionMetadata
from surge.kernels.deepseek_v4_reference import compress_windows, indexer_scores, indexer_topk


@dataclass(frozen=True)
class RowLayout:
    """Columns of one layer's token rows and entry rows. rate 0: a sliding layer (the key only, no entries);
    index_head_dim 0: no indexer."""
    head_dim: int
    rate: int = 0
    overlap: bool = False  # CSA's two series per token: windows of 2 x rate slots
    index_head_dim: int = 0

    def _token_spans(self) -> dict[str, int]:
        d, di = self.head_dim, self.index_head_dim
        spans = {"kv": d}
        if self.rate:
            state = 2 * d if self.overlap else d
            spans.update(state_kv=state, state_gate=state)
        if di:
            spans.update(index_kv=2 * di, index_gate=2 * di)
        return spans

    def _entry_spans(self) -> dict[str, int]:
        return {"entry": self.head_dim, **({"index_entry": self.index_head_dim} if self.index_head_dim else {})}

    def token_columns(self) -> tuple[str, ...]:
        """A token row's columns, in order."""
        return tuple(self._token_spans())

    def column(self, name: str) -> slice:
        """A token row's column, or an entry row's."""
        for spans in (self._token_spans(), self._entry_spans()):
            start = 0
            for key, width in spans.items():
                if key == name:
                    return slice(start, start + width)
                start += width
        raise KeyError(name)

    @property
    def width(self) -> int:
        return sum(self._token_spans().values())

    @property
    def entry_width(self) -> int:
        return sum(self._entry_spans().values()) if self.rate else 0

    def state_window(self) -> int:
        """Token rows the compressor reads back from a window's last token: its window, and CSA's one before."""
        return self.rate * (2 if self.overlap else 1)


@dataclass
class WindowCompressor:
    """One compressor's parameters as compress_windows reads them, and where its rows live."""
    position_bias: torch.Tensor  # [rate, state width] float32
    norm_weight: torch.Tensor  # [entry width] float32
    eps: float
    cos_cache: torch.Tensor  # the compress rope's tables [max_position, rope_dim / 2]
    sin_cache: torch.Tensor
    state_kv: slice  # token rows' columns
    state_gate: slice
    entry: slice  # the entry rows' column


def rows_of(cache: torch.Tensor) -> torch.Tensor:
    """A cache [1, blocks, rows_per_block, 1, width] as one row per slot."""
    return cache.view(-1, cache.shape[-1])


def slots_of(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Token-row slots of one request's positions through its block table."""
    return table.long()[positions // block_size] * block_size + positions % block_size


def entry_slots(table: torch.Tensor, windows: torch.Tensor, rate: int, block_size: int) -> torch.Tensor:
    """Entry-row slots of one request's windows through its entry group's block table: the row w % rows_per_block
    of the block holding the window's last token (CompressedEntrySpec's layout)."""
    rows_per_block = max(1, block_size // rate)
    return table.long()[(windows * rate + rate - 1) // block_size] * rows_per_block + windows % rows_per_block


def close_windows(rows: torch.Tensor, entries: torch.Tensor, meta: AttentionMetadata, entry_meta: AttentionMetadata,
                  block_size: int, rate: int, overlap: bool, comp: WindowCompressor) -> None:
    """Make the entries of the windows whose last token this step computes, from the token rows' state (this
    step's already written), into the entry rows."""
    qsl = meta.query_start_loc
    for r in range(meta.num_reqs):
        seq_len, n = meta.seq_lens[r], qsl[r + 1] - qsl[r]
        first, last = (seq_len - n) // rate, seq_len // rate  # windows first .. last - 1 close now
        if first == last:
            continue
        start = first - 1 if overlap and first > 0 else first  # CSA pools the window before's first series too
        table = meta.block_table[r]
        device = table.device
        state = slots_of(table, torch.arange(start * rate, last * rate, device=device), block_size)
        windows = torch.arange(start, last, device=device) * rate
        dtype = rows.dtype
        made = compress_windows(rows[state, comp.state_kv], rows[state, comp.state_gate], comp.position_bias,
                                comp.norm_weight, comp.eps, comp.cos_cache[windows].to(dtype),
                                comp.sin_cache[windows].to(dtype), rate, overlap)[first - start:]
        closing = torch.arange(first, last, device=device)
        entries[entry_slots(entry_meta.block_table[r], closing, rate, block_size), comp.entry] = made


def sink_attention(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [n, H, D] over shared key-values [L, D] where visible [n, L]; each head's sink logit joins the softmax's
    denominator (and adds no value). Float32; [n, H, D] in q's dtype."""
    scores = torch.einsum("nhd,ld->hnl", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hnl,ld->nhd", probs, keys.float()).to(q.dtype)


def select_entries(index_q: torch.Tensor, index_weights: torch.Tensor, index_keys: torch.Tensor,
                   complete: torch.Tensor, topk: int) -> torch.Tensor:
    """The lightning indexer's choice for n queries: index_q [n, Hi, Di] (rotated), index_weights [n, Hi]
    (weights_proj's output), index_keys [C, Di]; complete [n]: entries each query may see. Returns [n, C] bool: the
    topk best-scoring complete entries (all of them when fewer), ties to the lower index."""
    num_heads, head_dim = index_q.shape[1], index_q.shape[2]
    scores = indexer_scores(index_q, index_weights, index_keys, head_dim ** -0.5, num_heads ** -0.5)
    chosen = indexer_topk(scores, complete, topk).to(index_q.device).long()  # [n, k], -1 padded
    picked = torch.zeros(scores.shape[0], scores.shape[1] + 1, dtype=torch.bool, device=index_q.device)
    picked.scatter_(1, torch.where(chosen >= 0, chosen, scores.shape[1]), True)
    return picked[:, :-1]
