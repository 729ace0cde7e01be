"""Persistent input buffers for one model step: token ids, positions, and per-KV-group slot mappings and block
tables, sized by capacity. Each step fills a prefix; CUDA graphs capture views of these very tensors.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from surge.attention.backend import AttentionMetadata
from surge.core.scheduler import SchedulerOutput


class StepInputs:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, num_groups: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = [torch.zeros(max_tokens, dtype=torch.int64, device=device) for _ in range(num_groups)]
        self.block_tables = [torch.zeros(max_reqs, max_blocks_per_req, dtype=torch.int32, device=device)
                             for _ in range(num_groups)]
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self._staging: torch.Tensor | None = None  # packed host inputs (pinned on CUDA), grown on demand
        self._staging_dev: torch.Tensor | None = None

    def fill(self, out: SchedulerOutput) -> tuple[int, int, list[int], list[int]]:
        """Copy a step's inputs into the buffers; returns (num_tokens, num_reqs, query_start_loc, seq_lens).

        Everything is packed into one int64 host array and crosses to the device in a single copy, then is
        scattered into the typed buffers by device-side copies: per-step host work stays small at batch 1."""
        block_size = self.block_size
        scheduled = out.scheduled
        num_reqs = len(scheduled)
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
        seq_lens = starts + num_new
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if num_tokens == num_reqs:  # decode-only: one token each, the last known one
            token_ids = np.fromiter((s.request.token_ids[s.num_computed_tokens] for s in scheduled),
                                    dtype=np.int64, count=num_reqs)
            positions = starts
            req_of_token = np.arange(num_reqs)
        else:
            token_ids = np.fromiter(itertools.chain.from_iterable(
                s.request.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens]
                for s in scheduled), dtype=np.int64, count=num_tokens)
            req_of_token = np.repeat(np.arange(num_reqs), num_new)
            positions = np.arange(num_tokens) - query_start_loc[req_of_token] + starts[req_of_token]
        parts = [token_ids, positions, seq_lens, query_start_loc]
        widths = []
        for g in range(len(self.slot_mapping)):
            rows = [s.block_ids[g] for s in scheduled]
            width = max(len(r) for r in rows)
            table = np.zeros((num_reqs, width), dtype=np.int64)
            for i, r in enumerate(rows):
                table[i, :len(r)] = r
            slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
            parts += [slots, table.reshape(-1)]
            widths.append(width)
        packed = np.concatenate(parts)
        if self._staging is None or self._staging.numel() < packed.size:
            pin = self.device.type == "cuda"
            self._staging = torch.empty(max(packed.size, 1 << 16), dtype=torch.int64, pin_memory=pin)
            self._staging_dev = torch.empty(self._staging.numel(), dtype=torch.int64, device=self.device)
        host = self._staging[:packed.size]
        host.numpy()[:] = packed
        dev = self._staging_dev[:packed.size]
        dev.copy_(host, non_blocking=True)
        o = 0

        def take(n: int) -> torch.Tensor:
            nonlocal o
            o += n
            return dev[o - n:o]

        self.input_ids[:num_tokens].copy_(take(num_tokens))
        self.positions[:num_tokens].copy_(take(num_tokens))
        self.seq_lens[:num_reqs].copy_(take(num_reqs))
        self.query_start_loc[:num_reqs + 1].copy_(take(num_reqs + 1))
        for g, width in enumerate(widths):
            self.slot_mapping[g][:num_tokens].copy_(take(num_tokens))
            self.block_tables[g][:num_reqs, :width].copy_(take(num_reqs * width).view(num_reqs, width))
        return num_tokens, num_reqs, query_start_loc.tolist(), seq_lens.tolist()

    def pad_decode(self, num_reqs: int, padded: int) -> None:
        """Rows num_reqs..padded of a captured decode graph: one token each, in the null block, context 1.
        They compute garbage that nobody reads, and write only to the null block."""
        if padded == num_reqs:
            return
        self.input_ids[num_reqs:padded].zero_()
        self.positions[num_reqs:padded].zero_()
        for slots, table in zip(self.slot_mapping, self.block_tables):
            slots[num_reqs:padded].zero_()
            table[num_reqs:padded].zero_()
        self.seq_lens[num_reqs:padded].fill_(1)
        self.query_start_loc[num_reqs + 1:padded + 1].copy_(
            torch.arange(num_reqs + 1, padded + 1, dtype=torch.int32), non_blocking=True)

    def metadata(self, num_tokens: int, num_reqs: int, query_start_loc: list[int], seq_lens: list[int],
                 max_query_len: int, max_seq_len: int) -> AttentionMetadata:
        width = self.block_tables[0].shape[1]
        if seq_lens:
            width = min(width, -(-max(seq_lens) // self.block_size))
        return AttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_tokens, query_start_loc=query_start_loc, seq_lens=seq_lens,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            slot_mapping=[s[:num_tokens] for s in self.slot_mapping],
            block_tables=[t[:num_reqs, :width] for t in self.block_tables],
            query_start_loc_t=self.query_start_loc[:num_reqs + 1], seq_lens_t=self.seq_lens[:num_reqs])
