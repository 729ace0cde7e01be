"""The n-gram proposer (prompt lookup): find the request's last n tokens earlier in its own prompt and output, and
propose the k tokens that followed there. No model; numpy over the whole sequence at once, longest n first. Its
device twin, for async scheduling, is surge/worker/ngram_lookup.py.
"""
from __future__ import annotations

import numpy as np
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
