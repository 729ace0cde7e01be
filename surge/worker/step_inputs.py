"""Persistent input buffers for one model step: token ids, positions, and per-KV-group slot mappings and block
tables, sized by capacity. Each step fills a prefix; CUDA graphs capture views of these very tensors.

An M-RoPE model (Qwen2.5-VL) also gets `mrope_positions` [3, T]: a prompt token's three positions from its request's
table, any later token's sequence position + the request's delta on all three. The 1-D `positions` stay the sequence
positions, which the KV slots follow.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from surge.attention.backend import AttentionBackend, AttentionMetadata, CommonAttentionMetadata
from surge.core.scheduler_output import ScheduledRequest
from surge.worker.request_state import CachedRequestState


@dataclass
class DeviceDrafts:
    """What a step leaves on the device for its sampling requests' next step when that one is scheduled ahead of
    the verdict (ScheduledRequest.device_drafts): row rows[request id] of tokens [n, 1 + k] holds the request's
    newest token and the k drafts proposed after it; rejected [n] the drafts the step rejected (0 for a request
    that sampled without drafts), by which the next step starts earlier than the host counted."""
    rows: dict[str, int]
    tokens: torch.Tensor
    rejected: torch.Tensor

    @classmethod
    def of(cls, request_ids: list[str], newest: torch.Tensor, drafts: torch.Tensor,
           rejected: torch.Tensor) -> DeviceDrafts:
        """From per-request rows in request_ids' order: newest tokens [n], drafts [n, k], rejected [n]."""
        return cls({rid: j for j, rid in enumerate(request_ids)}, torch.cat((newest[:, None], drafts), dim=1),
                   rejected)


class StepInputs:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, num_groups: int, block_size: int,
                 device: torch.device, mrope: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        # Rows past a step's tokens (graph padding) keep older steps' values: positions still inside the rotary table.
        self.mrope_positions = torch.zeros(3, max_tokens, dtype=torch.int64, device=device) if mrope else None
        self.slot_mapping = [torch.zeros(max_tokens, dtype=torch.int64, device=device) for _ in range(num_groups)]
        self.block_tables = [torch.zeros(max_reqs, max_blocks_per_req, dtype=torch.int32, device=device)
                             for _ in range(num_groups)]
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        # Packed host inputs (pinned on CUDA), two used in turn, grown on demand; and their device copy.
        self._staging: list[torch.Tensor | None] = [None, None]
        self._staging_np: list[np.ndarray | None] = [None, None]  # their numpy views
        self._turn = 0
        self._staging_dev: torch.Tensor | None = None
        self._arange = torch.arange(max_reqs + 1, dtype=torch.int32, device=device)
        # The mixed-graph padding the buffers hold now, as pad_mixed's arguments: a replay that wants the same need
        # not write it again (fill lays it out with the step's own copies). Anything else that writes them clears it.
        self._padding: tuple[int, int, int, int] | None = None
        # Rows scheduled ahead are corrected by one kernel on CUDA (surge/kernels/ahead_rows.py), by torch ops
        # elsewhere (and for more than two KV cache groups, which the kernel does not take).
        self.use_ahead_kernel = device.type == "cuda" and num_groups <= 2

    def fill(self, scheduled: list[ScheduledRequest], states: list[CachedRequestState],
             last_sampled: torch.Tensor | None = None, last_rows: dict[str, int] | None = None,
             mixed_padding: Callable[[int, int], tuple[int, int] | None] | None = None,
             ahead: DeviceDrafts | None = None, exact_host_lengths: bool = True
             ) -> tuple[int, int, list[int], list[int]]:
        """Copy a step's inputs into the buffers; returns (num_tokens, num_reqs, query_start_loc, seq_lens).

        Everything is packed into one int64 host array and crosses to the device in a single copy, then is
        scattered into the typed buffers by device-side copies: per-step host work stays small at batch 1.
        A token still pending (sampled by the step before, not on the host yet) is taken on the device from
        last_sampled[last_rows[request id]]; draft tokens follow the known ones. A mixed step that
        mixed_padding(num_tokens, num_reqs) gives a graph's (padded_tokens, padded_reqs) comes with pad_mixed's
        layout in the same copies: at batch 1 its five fills were a tenth of a verification step's host time.

        A request scheduled ahead of its verdict takes its 1 + k tokens from ahead.tokens and starts ahead.rejected
        positions before its num_computed_tokens: its positions, slots and length are corrected on the device,
        after the copies. The host's lengths are then upper bounds, made exact (reading the device) only when
        exact_host_lengths: a backend that reads lengths on the host (one that cannot replay CUDA graphs)."""
        block_size = self.block_size
        num_reqs = len(scheduled)
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
        seq_lens = starts + num_new
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        pending_dst, pending_src = [], []  # token index in this step, row of last_sampled
        ahead_reqs, ahead_rows = [], []  # request index in this step, row of ahead.tokens
        token_list: list[int] = []
        for i, (s, state) in enumerate(zip(scheduled, states)):
            if s.device_drafts:
                if ahead is None or s.request_id not in ahead.rows or s.num_new_tokens != 1 + s.device_drafts:
                    raise RuntimeError(f"request {s.request_id!r} is scheduled ahead of its verdict, but the step "
                                       "before left no drafts for it on the device")
                token_list.extend([0] * s.num_new_tokens)
                ahead_reqs.append(i)
                ahead_rows.append(ahead.rows[s.request_id])
                continue
            known = state.token_ids + s.spec_token_ids if s.spec_token_ids else state.token_ids
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            if end <= len(known):
                token_list.extend(known[start:end])
                continue
            # Only the one token after the known ones can be pending, and only a decode row asks for it.
            if end != len(known) + 1 or last_rows is None or s.request_id not in last_rows:
                raise RuntimeError(f"request {s.request_id!r}: tokens [{start}, {end}) are scheduled but "
                                   f"only {len(known)} are known and the previous step sampled none for it")
            token_list.extend(known[start:end - 1])
            token_list.append(0)
            pending_dst.append(int(query_start_loc[i + 1]) - 1)
            pending_src.append(last_rows[s.request_id])
        token_ids = np.asarray(token_list, dtype=np.int64)
        if num_tokens == num_reqs:  # decode-only: one token each
            positions = starts
            req_of_token = np.arange(num_reqs)
        else:
            req_of_token = np.repeat(np.arange(num_reqs), num_new)
            positions = np.arange(num_tokens) - query_start_loc[req_of_token] + starts[req_of_token]
        pad = mixed_padding(num_tokens, num_reqs) if mixed_padding is not None and num_tokens > num_reqs else None
        tokens_out, reqs_out = pad or (num_tokens, num_reqs)  # lengths written, the padding included

        # (values, length written, fill for the rest: a mixed graph's padding), in the order the copies take them.
        parts = [(token_ids, tokens_out, 0), (positions, tokens_out, 0), (seq_lens, reqs_out, 0),
                 (query_start_loc, reqs_out + 1, num_tokens)]
        if self.mrope_positions is not None:
            parts += [(row, tokens_out, 0) for row in _mrope_positions(states, positions, req_of_token,
                                                                         query_start_loc, starts, seq_lens)]
        widths = []
        for g in range(len(self.slot_mapping)):
            rows = [state.block_ids[g] for state in states]
            width = max(len(r) for r in rows)
            table = np.zeros((num_reqs, width), dtype=np.int64)
            for i, r in enumerate(rows):
                table[i, :len(r)] = r
            slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
            parts += [(slots, tokens_out, -1), (table.reshape(-1), num_reqs * width, 0)]
            widths.append(width)
        parts += [(np.asarray(pending_dst, dtype=np.int64), len(pending_dst), 0),
                  (np.asarray(pending_src, dtype=np.int64), len(pending_src), 0)]
        if ahead_reqs:
            # The kernel's meta: per request, its index, its row, its first token. The torch ops': per token of
            # those rows, its index, its request's index, where its value sits in ahead.tokens (flat) and its
            # request's row there; then per request, its index and its row.
            width = ahead.tokens.shape[1]
            reqs, rows = np.asarray(ahead_reqs, dtype=np.int64), np.asarray(ahead_rows, dtype=np.int64)
            if self.use_ahead_kernel:
                ahead_parts = [np.stack((reqs, rows, query_start_loc[reqs]), axis=1).reshape(-1)]
            else:
                col = np.arange(width, dtype=np.int64)
                tok_req, tok_row = np.repeat(reqs, width), np.repeat(rows, width)
                ahead_parts = [(query_start_loc[reqs][:, None] + col).reshape(-1), tok_req,
                               (rows[:, None] * width + col).reshape(-1), tok_row, reqs, rows]
            parts += [(a, a.size, 0) for a in ahead_parts]
        size = sum(n for _, n, _ in parts)
        # Two staging buffers, used in turn: with a step in flight, its copy may not have read its buffer yet.
        self._turn ^= 1
        staging = self._staging[self._turn]
        if staging is None or staging.numel() < size:
            pin = self.device.type == "cuda"
            staging = self._staging[self._turn] = torch.empty(max(size, 1 << 16), dtype=torch.int64, pin_memory=pin)
            self._staging_np[self._turn] = staging.numpy()
        if self._staging_dev is None or self._staging_dev.numel() < size:
            self._staging_dev = torch.empty(max(size, 1 << 16), dtype=torch.int64, device=self.device)
        packed, o = self._staging_np[self._turn], 0  # written in place: no concatenation, no second host copy
        for values, n, fill in parts:
            packed[o:o + values.size] = values
            packed[o + values.size:o + n] = fill
            o += n
        host = staging[:size]
        dev = self._staging_dev[:size]
        dev.copy_(host, non_blocking=True)
        o = 0

        def take(n: int) -> torch.Tensor:
            nonlocal o
            o += n
            return dev[o - n:o]

        self.input_ids[:tokens_out].copy_(take(tokens_out))
        self.positions[:tokens_out].copy_(take(tokens_out))
        self.seq_lens[:reqs_out].copy_(take(reqs_out))
        self.query_start_loc[:reqs_out + 1].copy_(take(reqs_out + 1))
        if self.mrope_positions is not None:
            for axis in range(3):
                self.mrope_positions[axis, :tokens_out].copy_(take(tokens_out))
        for g, width in enumerate(widths):
            self.slot_mapping[g][:tokens_out].copy_(take(tokens_out))
            self.block_tables[g][:num_reqs, :width].copy_(take(num_reqs * width).view(num_reqs, width))
        if pending_dst:
            dst, src = take(len(pending_dst)), take(len(pending_src))
            self.input_ids.index_copy_(0, dst, last_sampled.index_select(0, src))
        seq_lens_host = seq_lens.tolist()
        if ahead_reqs and self.use_ahead_kernel:
            from surge.kernels.ahead_rows import correct_ahead_rows  # (imported late: see DeviceNgram.step)

            meta = take(3 * len(ahead_reqs)).view(-1, 3)
            correct_ahead_rows(meta, ahead.tokens, ahead.rejected, self.input_ids, self.positions, self.seq_lens,
                               self.slot_mapping, self.block_tables, block_size)
            if exact_host_lengths:
                for i, r in zip(ahead_reqs, ahead.rejected.index_select(0, meta[:, 1]).tolist()):
                    seq_lens_host[i] -= r
        elif ahead_reqs:
            m, a = len(ahead_reqs) * ahead.tokens.shape[1], len(ahead_reqs)
            tok, tok_req, src, tok_row, reqs, rows = take(m), take(m), take(m), take(m), take(a), take(a)
            self.input_ids.index_copy_(0, tok, ahead.tokens.reshape(-1).index_select(0, src))
            pos = self.positions.index_select(0, tok) - ahead.rejected.index_select(0, tok_row)
            self.positions.index_copy_(0, tok, pos)
            for slots, table in zip(self.slot_mapping, self.block_tables):
                blocks = table[tok_req, pos // block_size].long()
                slots.index_copy_(0, tok, blocks * block_size + pos % block_size)
            rejected = ahead.rejected.index_select(0, rows)
            self.seq_lens.index_copy_(0, reqs, self.seq_lens.index_select(0, reqs) - rejected.int())
            if exact_host_lengths:
                for i, r in zip(ahead_reqs, rejected.tolist()):
                    seq_lens_host[i] -= r
        self._padding = (num_tokens, num_reqs, *pad) if pad else None
        return num_tokens, num_reqs, query_start_loc.tolist(), seq_lens_host

    def model_positions(self, num_tokens: int) -> torch.Tensor:
        """The positions the model takes: [num_tokens], or [3, num_tokens] for an M-RoPE model."""
        if self.mrope_positions is not None:
            return self.mrope_positions[:, :num_tokens]
        return self.positions[:num_tokens]

    def warm_up_ahead(self, k: int) -> None:
        """Compile the ahead rows' kernel for k drafts, so the first step scheduled ahead does not wait for it."""
        if self.use_ahead_kernel:
            from surge.kernels.ahead_rows import warm_up_ahead_rows

            warm_up_ahead_rows(k, self.input_ids, self.positions, self.seq_lens, self.slot_mapping,
                               self.block_tables, self.block_size)

    def pad_decode(self, num_reqs: int, padded: int) -> None:
        """Rows num_reqs..padded of a captured decode graph: one token each, in the null block, context 1.
        They compute garbage that nobody reads, and write only to the null block."""
        self._padding = None
        if padded == num_reqs:
            return
        self.input_ids[num_reqs:padded].zero_()
        self.positions[num_reqs:padded].zero_()
        for slots, table in zip(self.slot_mapping, self.block_tables):
            slots[num_reqs:padded].zero_()
            table[num_reqs:padded].zero_()
        self.seq_lens[num_reqs:padded].fill_(1)
        self.query_start_loc[num_reqs + 1:padded + 1].copy_(self._arange[num_reqs + 1:padded + 1])

    def pad_mixed(self, num_tokens: int, num_reqs: int, padded_tokens: int, padded_reqs: int) -> None:
        """Tokens num_tokens..padded_tokens and request rows num_reqs..padded_reqs of a captured mixed graph: the
        rows have no tokens (their attention tiles return at once) and the tokens belong to no request, write no KV
        (slot -1) and leave attention rows nobody reads. They never read a block table, however many they are.
        Nothing to do when the buffers hold this very layout (fill wrote it, or the replay before this one)."""
        if self._padding == (num_tokens, num_reqs, padded_tokens, padded_reqs):
            return
        self.input_ids[num_tokens:padded_tokens].zero_()
        self.positions[num_tokens:padded_tokens].zero_()  # within the rotary table whatever max_model_len is
        for slots in self.slot_mapping:
            slots[num_tokens:padded_tokens].fill_(-1)
        self.seq_lens[num_reqs:padded_reqs].zero_()
        self.query_start_loc[num_reqs + 1:padded_reqs + 1].fill_(num_tokens)
        self._padding = (num_tokens, num_reqs, padded_tokens, padded_reqs)

    def metadata(self, backend: AttentionBackend, num_tokens: int, num_reqs: int, query_start_loc: list[int],
                 seq_lens: list[int], max_query_len: int, max_seq_len: int,
                 for_capture: bool = False) -> list[AttentionMetadata]:
        """One metadata per KV cache group, built by the backend over views of these buffers."""
        width = self.block_tables[0].shape[1]
        if seq_lens:
            width = min(width, -(-max(seq_lens) // self.block_size))
        common = CommonAttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_tokens, query_start_loc=query_start_loc, seq_lens=seq_lens,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            query_start_loc_t=self.query_start_loc[:num_reqs + 1], seq_lens_t=self.seq_lens[:num_reqs])
        build = backend.build_for_graph_capture if for_capture else backend.build_metadata
        return [build(common, slots[:num_tokens], table[:num_reqs, :width])
                for slots, table in zip(self.slot_mapping, self.block_tables)]


def _mrope_positions(states: list[CachedRequestState], positions: np.ndarray, req_of_token: np.ndarray,
                     query_start_loc: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """[3, num_tokens]: each token's sequence position + its request's delta, then the prompt tokens of requests
    with images from their tables (CachedRequestState.mrope_positions). Chunked prefill, prefix-cache hits and
    preemption only move `starts`, so each token gets the same three positions whichever step computes it."""
    deltas = np.fromiter((s.mrope_delta for s in states), dtype=np.int64, count=len(states))
    out = np.repeat((positions + deltas[req_of_token])[None, :], 3, axis=0)
    for i, state in enumerate(states):
        table = state.mrope_positions
        if table is not None and starts[i] < table.shape[1]:
            end = min(int(ends[i]), table.shape[1])
            lo = int(query_start_loc[i])
            out[:, lo:lo + end - int(starts[i])] = table[:, starts[i]:end]
    return out
