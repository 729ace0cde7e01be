"""The n-gram proposer (prompt lookup): find the request's last n tokens earlier in its own prompt and output, and
propose the k tokens that followed there. No model; numpy over the whole sequence at once, longest n first.
"""
from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from surge.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to k tokens (fewer near the end of the known sequence or of max_tokens; none without a match). The
        match is the most recent earlier occurrence of the longest suffix of length max_n..min_n."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        n_total = len(token_ids)
        if k <= 0 or n_total <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, n_total - 1), self.min_n - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)  # every n-gram that ends before the last token
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the tokens right after the most recent match
                return tokens[start:start + k].tolist()
        return []


class DeviceNgram:
    """The same lookup on the device, over a token history the device keeps for every request: with async scheduling
    a request's newest tokens (the verdict of the step in flight) never reach the host before its next step is
    launched, so the drafts for that step are looked up where those tokens are.

    Each request owns a row of `tokens` ([rows, width]); the runner writes its known tokens once, when it first
    samples, and every sampling step appends its new tokens there (`append`), so the row stays ahead of the host.
    `propose` matches like NgramProposer.propose (the longest suffix of length max_n..min_n seen earlier, its most
    recent occurrence) for a batch of rows at once, in fixed-shape tensor ops: nothing is read back to the host."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, device: torch.device) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.device = device
        # Room past max_model_len for an append's unused columns (a verdict writes its k + 1 tokens, keeps 1 + j).
        self.width = max_model_len + self.k + 1
        self.tokens = torch.zeros(0, self.width, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(0, dtype=torch.int64, device=device)
        self.row_of: dict[str, int] = {}
        self._free: list[int] = []

    def add(self, request_id: str, token_ids: torch.Tensor) -> int:
        """A row for the request, holding token_ids (a device tensor); the tensors grow by doubling when full."""
        if not self._free:
            old = self.tokens.shape[0]
            new = max(8, 2 * old)
            tokens = torch.zeros(new, self.width, dtype=torch.int64, device=self.device)
            tokens[:old] = self.tokens
            lengths = torch.zeros(new, dtype=torch.int64, device=self.device)
            lengths[:old] = self.lengths
            self.tokens, self.lengths = tokens, lengths
            self._free = list(range(new - 1, old - 1, -1))
        row = self._free.pop()
        n = token_ids.shape[0]
        self.tokens[row, :n] = token_ids
        self.lengths[row] = n
        self.row_of[request_id] = row
        return row

    def remove(self, request_ids) -> None:
        for rid in request_ids:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self._free.append(row)

    def append(self, rows: torch.Tensor, new_tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Row rows[i] gains new_tokens[i, :counts[i]] ([n, w] and [n], on the device): all w are written past its
        end, and its length grows by counts[i] (the columns past it are scratch, overwritten by the next append)."""
        cols = self.lengths[rows][:, None] + torch.arange(new_tokens.shape[1], device=self.device)
        self.tokens[rows[:, None], cols] = new_tokens
        self.lengths[rows] += counts

    def propose(self, rows: torch.Tensor, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [n, k], valid [n]) for rows (device [n]) no longer than max_length (a bound the host knows):
        drafts[i, :valid[i]] is NgramProposer.propose's answer for row i; the columns after hold the row's last
        token (a guess the verification may still accept), so every row carries k tokens to verify."""
        n, k, m, width = rows.shape[0], self.k, self.max_n, min(max_length, self.width)
        hist = self.tokens[rows, :width]  # [n, L]
        length = self.lengths[rows]  # [n]
        idx = torch.arange(width, device=self.device)
        # windows[i, e, t] = hist[i, e - t]: the m tokens ending at e, newest first (-1 before the row's start), and
        # the suffix likewise from the row's last token; run[i, e] = how many of them agree, newest first. -1
        # agrees with -1 before both starts: the run is cut to the tokens there are (e + 1, and the row's length).
        padded = torch.nn.functional.pad(hist, (m - 1, 0), value=-1)
        windows = padded.unfold(1, m, 1).flip(2)  # [n, L, m]
        suffix = windows.gather(1, (length - 1).clamp_min(0)[:, None, None].expand(n, 1, m))  # [n, 1, m]
        run = (windows == suffix).cumprod(dim=2).sum(dim=2)
        run = torch.minimum(torch.minimum(run, idx[None, :] + 1), length[:, None])
        # A match ends before the last token and is at least min_n long.
        run = torch.where((idx[None, :] <= length[:, None] - 2) & (run >= self.min_n), run, 0)
        best = run.max(dim=1).values  # [n]: the longest n that matched, 0: none
        # The most recent end position with that length: the largest e whose run equals best.
        end = torch.where((run == best[:, None]) & (best[:, None] > 0), idx[None, :], -1).max(dim=1).values
        start = end + 1
        valid = torch.where(best > 0, (length - start).clamp_max(k), 0)
        cols = torch.arange(k, device=self.device)[None, :]
        last = hist.gather(1, (length - 1).clamp_min(0)[:, None])
        drafts = torch.where(cols < valid[:, None], hist.gather(1, (start[:, None] + cols).clamp(0, width - 1)), last)
        return drafts, valid
