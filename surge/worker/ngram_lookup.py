"""The n-gram proposer's device twin, for async scheduling: a request's newest tokens (the verdict of the step in
flight) never reach the host before its next step is launched, so the drafts for that step are looked up where
those tokens are.

Each request owns a row of `tokens` ([rows, width]); the runner writes its known tokens once, when it first
samples, and every sampling step appends its new tokens there, so the row stays ahead of the host. The lookup is
NgramProposer.propose's (the longest suffix of length max_n..min_n seen earlier, its most recent occurrence), for a
batch of rows at once, reading nothing back to the host. On CUDA one kernel appends and looks up
(surge/kernels/ngram.py); elsewhere the same in torch ops (`append`, `propose`), which also serve as its
reference in the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from surge.config import SpeculativeConfig
from surge.model.layers.sampler import device_tensor


@dataclass
class Verdicts:
    """Where verified requests' new tokens are: verdict i is tokens[starts[i]:starts[i] + accepted[i] + 1] (the
    accepted drafts, then the token after them) of a request that verified num_drafts[i] drafts."""
    tokens: torch.Tensor  # 1-D
    starts: list[int]
    num_drafts: list[int]
    accepted: torch.Tensor  # [n], any stride


class DeviceNgram:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, device: torch.device,
                 use_kernel: bool | None = None) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.device = device
        self.use_kernel = device.type == "cuda" if use_kernel is None else use_kernel
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
        self.lengths[row:row + 1].fill_(n)  # not `lengths[row] = n`: on CUDA that copies a host scalar and waits
        self.row_of[request_id] = row
        return row

    def remove(self, request_ids) -> None:
        for rid in request_ids:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self._free.append(row)

    def warm_up(self) -> None:
        """Compile the kernel before the first request needs it."""
        if self.use_kernel:
            from surge.kernels.ngram import warm_up_ngram_step

            tokens = torch.zeros(1, self.width, dtype=torch.int64, device=self.device)
            warm_up_ngram_step(tokens, self.k, self.min_n, self.max_n)

    def step(self, rows: list[int], sampled: torch.Tensor | None, verdicts: Verdicts | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """New tokens into rows (the first len(sampled) rows gain sampled[i]; the rest, verdict by verdict, their
        verdict's tokens), then their lookup. Returns (tokens [n, 1 + k]: each row's newest token, then its k
        drafts; rejected [n]: the drafts its verdict rejected, 0 for a sampled row; valid [n]: how many of the
        drafts the lookup found, the columns after them repeating the newest token), all on the device."""
        num_sampled = 0 if sampled is None else sampled.shape[0]
        if self.use_kernel:
            # Imported here, not with the module: the kernel is defined for Triton's interpreter when the tests set
            # it, which they do only after importing the engine.
            from surge.kernels.ngram import META_COLUMNS, ngram_step

            meta = np.zeros((len(rows), META_COLUMNS), dtype=np.int64)
            meta[:, 0] = rows
            meta[:num_sampled, 2] = np.arange(num_sampled)
            if verdicts is not None:
                meta[num_sampled:, 1] = 1
                meta[num_sampled:, 2] = verdicts.starts
                meta[num_sampled:, 3] = verdicts.num_drafts
                meta[num_sampled:, 4] = np.arange(len(rows) - num_sampled)
            placeholder = self.lengths  # a source that is absent is never read
            return ngram_step(self.tokens, self.lengths, device_tensor(meta, self.device),
                              placeholder if sampled is None else sampled,
                              placeholder if verdicts is None else verdicts.tokens,
                              placeholder if verdicts is None else verdicts.accepted,
                              self.k, self.min_n, self.max_n)
        width = self.k + 1  # tokens a row may gain
        parts, counts, newest, rejected = [], [], [], []
        if sampled is not None:
            parts.append(sampled.long()[:, None].expand(num_sampled, width))
            counts.append(torch.ones(num_sampled, dtype=torch.int64, device=self.device))
            newest.append(sampled.long())
            rejected.append(torch.zeros(num_sampled, dtype=torch.int64, device=self.device))
        if verdicts is not None:
            num_drafts = np.asarray(verdicts.num_drafts, dtype=np.int64)
            cols = np.minimum(np.arange(width)[None, :], num_drafts[:, None])
            tokens = verdicts.tokens.long()[device_tensor(np.asarray(verdicts.starts)[:, None] + cols, self.device)]
            accepted = verdicts.accepted.long()
            parts.append(tokens)
            counts.append(accepted + 1)
            newest.append(tokens.gather(1, accepted[:, None])[:, 0])
            rejected.append(device_tensor(num_drafts, self.device) - accepted)
        rows_t = device_tensor(rows, self.device, torch.long)
        self.append(rows_t, torch.cat(parts), torch.cat(counts))
        drafts, valid = self.propose(rows_t, int(self.lengths[rows_t].max()))  # a host read: not on CUDA
        return torch.cat((torch.cat(newest)[:, None], drafts), dim=1), torch.cat(rejected), valid

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
