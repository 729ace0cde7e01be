"""Persistent input buffers for one model step: token ids, positions, and per-KV-group slot mappings and block
tables, sized by capacity. Each step fills a prefix; CUDA graphs capture views of these very tensors.
"""
from __future__ import annotations

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

    def fill(self, out: SchedulerOutput) -> tuple[int, int, list[int], list[int]]:
        """Copy a step's inputs into the buffers; returns (num_tokens, num_reqs, query_start_loc, seq_lens)."""
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens = []
        for s in out.scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            token_ids.extend(s.request.token_ids[start:end])
            positions.extend(range(start, end))
            query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
            seq_lens.append(end)
        num_tokens, num_reqs = len(token_ids), len(out.scheduled)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        req_of_token = torch.repeat_interleave(torch.arange(num_reqs),
                                               torch.tensor([s.num_new_tokens for s in out.scheduled]))
        pin = self.device.type == "cuda"
        for g, (slots_buf, table_buf) in enumerate(zip(self.slot_mapping, self.block_tables)):
            rows = [s.block_ids[g] for s in out.scheduled]
            width = max(len(r) for r in rows)
            table = torch.zeros(num_reqs, width, dtype=torch.int32, pin_memory=pin)
            for i, r in enumerate(rows):
                table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
            slots = table[req_of_token, pos_t // block_size].long() * block_size + pos_t % block_size
            slots_buf[:num_tokens].copy_(slots, non_blocking=True)
            table_buf[:num_reqs, :width].copy_(table, non_blocking=True)
        self.input_ids[:num_tokens].copy_(torch.tensor(token_ids, dtype=torch.int64), non_blocking=True)
        self.positions[:num_tokens].copy_(pos_t, non_blocking=True)
        self.seq_lens[:num_reqs].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self.query_start_loc[:num_reqs + 1].copy_(torch.tensor(query_start_loc, dtype=torch.int32),
                                                  non_blocking=True)
        return num_tokens, num_reqs, query_start_loc, seq_lens

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
