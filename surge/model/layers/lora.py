"""LoRA on the linear layers: each adapted layer adds x @ A^T @ B^T (the scaling folded into B) to its output, per
token by the token's adapter slot (-1: the base model, nothing added).

A layer's adapters sit in a slot pool: A [max_loras, slices * max_rank, in_local] and B [max_loras, out_local,
max_rank], zero-padded past an adapter's own rank. A merged layer (q/k/v, gate/up) has one A/B per projection, its
B rows where the layer's `shard_layout` puts that projection's rows, so one shrink and one expand serve them all.
Tensor parallelism shards them as the base weight: column-parallel B by output rows, row-parallel A by input
columns, the delta added before the all-reduce. The step's mapping (LoRAMapping) lives in persistent buffers, which
CUDA graphs capture. On CUDA the Triton kernels (surge/kernels/lora.py) run; elsewhere a loop over the step's
adapters in torch.
"""
from __future__ import annotations

import numpy as np
import torch


def group_by_slot(token_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token indices sorted by slot (stable), and the slots >= 0 present with their first index in that order and
    their token count."""
    order = np.argsort(token_slot, kind="stable")
    slots, starts, counts = np.unique(token_slot[order], return_index=True, return_counts=True)
    keep = slots >= 0
    return order, slots[keep], starts[keep], counts[keep]


class LoRAMapping:
    """The step's tokens grouped by adapter slot. For the kernels (use_kernels; by default on CUDA), in persistent
    buffers: token indices sorted by slot (sorted_tokens), and per group g < max_loras its slot (slot_ids[g], -1:
    unused), first index in sorted_tokens and token count. For the torch path, host index tensors per slot."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device,
                 use_kernels: bool | None = None) -> None:
        self.max_loras = max_loras
        self.device = device
        self.use_kernels = device.type == "cuda" if use_kernels is None else use_kernels
        self.sorted_tokens = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        # slot_ids, group_start, group_len: one [3, max_loras] buffer filled by one copy.
        self.groups_t = torch.zeros(3, max_loras, dtype=torch.int32, device=device)
        self.groups_t[0].fill_(-1)
        self.slot_ids, self.group_start, self.group_len = self.groups_t.unbind(0)
        self.num_groups = 0  # adapters in the step (0: nothing to add)
        self.graph_kernels = True  # False while the graph runner captures its adapter-free decode graphs
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # host: (slot, token indices; None: every token)
        self._staging = [None, None]  # host buffers (pinned on CUDA), used in turn: a copy may still read the other
        self._turn = 0

    def set(self, slot_per_request: list[int], num_tokens_per_request: list[int]) -> None:
        """The step's requests, in step order: each one's slot (-1: none) and its token count this step."""
        token_slot = np.repeat(np.asarray(slot_per_request, dtype=np.int64), num_tokens_per_request)
        self.set_tokens(token_slot)

    def set_tokens(self, token_slot: np.ndarray) -> None:
        """Each token's slot (-1: none)."""
        order, slots, starts, counts = group_by_slot(token_slot)
        assert len(slots) <= self.max_loras, (slots, self.max_loras)
        self.num_groups = len(slots)
        if not self.use_kernels:
            self.groups = [(int(s), None if c == len(token_slot)
                            else torch.from_numpy(order[b:b + c]).to(self.device))
                           for s, b, c in zip(slots, starts, counts)]
            return
        m = self.max_loras
        size = 3 * m + len(order)
        self._turn ^= 1
        staging = self._staging[self._turn]
        if staging is None or staging.numel() < size:
            staging = self._staging[self._turn] = torch.empty(max(size, 4096), dtype=torch.int32,
                                                              pin_memory=self.device.type == "cuda")
        packed = staging[:size].numpy()
        packed[:3 * m] = 0
        packed[:m] = -1
        packed[:len(slots)], packed[m:m + len(slots)], packed[2 * m:2 * m + len(slots)] = slots, starts, counts
        packed[3 * m:] = order
        self.groups_t.view(-1).copy_(staging[:3 * m], non_blocking=True)
        self.sorted_tokens[:len(order)].copy_(staging[3 * m:size], non_blocking=True)


class LinearLoRA:
    """The adapter slots of one linear layer. slices: (first local output row, rows) of each projection, in the
    order an adapter's parts are given (a merged layer's shard order)."""

    def __init__(self, in_features: int, slices: list[tuple[int, int]], max_loras: int, max_rank: int,
                 mapping: LoRAMapping, dtype: torch.dtype, device: torch.device) -> None:
        self.slices = slices
        self.max_rank = max_rank
        self.mapping = mapping
        out_features = sum(size for _, size in slices)
        self.a = torch.zeros(max_loras, len(slices) * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device)
        self.slice_offsets = torch.tensor([o for o, _ in slices] + [out_features], dtype=torch.int32, device=device)
        self.slice_key = tuple(slices)  # hashable: the kernels' launch policy is cached by it

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slice index -> (A [r, in_local], B [rows, r], the scaling folded in), already sharded for this rank;
        slices not given get zeros."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        r_max = self.max_rank
        for j, (a, b) in parts.items():
            r = a.shape[0]
            offset, size = self.slices[j]
            self.a[slot, j * r_max:j * r_max + r].copy_(a)
            self.b[slot, offset:offset + size, :r].copy_(b)

    def warm_up(self, num_tokens: int, dtype: torch.dtype) -> None:
        """Compile the kernels for this layer's shapes at num_tokens' launch policy, over a mapping of its own with
        no adapter (the step's may be in use: under background graph capture the engine serves meanwhile)."""
        m = LoRAMapping(1, self.mapping.max_loras, self.mapping.device, use_kernels=True)
        device = self.a.device
        x = torch.zeros(num_tokens, self.a.shape[2], dtype=dtype, device=device)
        y = torch.zeros(num_tokens, self.b.shape[1], dtype=dtype, device=device)
        self._kernels(y, x, m)

    def add_(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += this step's adapters' deltas, token by token."""
        m = self.mapping
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            if not m.graph_kernels:
                return  # a graph for steps without adapters: nothing to record
        elif not m.num_groups:
            return  # no adapter in this step (a graph being captured records the launches for steps with some)
        if m.use_kernels:
            self._kernels(y, x, m)
            return
        r = self.max_rank
        for slot, idx in m.groups:
            xs = x if idx is None else x.index_select(0, idx)
            s = xs @ self.a[slot].t()
            for j, (offset, size) in enumerate(self.slices):
                delta = s[:, j * r:(j + 1) * r] @ self.b[slot, offset:offset + size].t()
                out = y[:, offset:offset + size]
                if idx is None:
                    out.add_(delta)
                else:
                    out.index_add_(0, idx, delta)

    def _kernels(self, y: torch.Tensor, x: torch.Tensor, m: LoRAMapping) -> None:
        from surge.kernels.lora import lora_add  # Triton (CUDA, or interpreted)

        lora_add(x, self.a, self.b, y, self.slice_offsets, self.slice_key, m.sorted_tokens, m.slot_ids,
                 m.group_start, m.group_len)
