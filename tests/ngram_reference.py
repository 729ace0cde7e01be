"""The n-gram lookup written as plainly as possible: the reference for the proposer, its device twin and the kernel."""
from __future__ import annotations


def reference_propose(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix (hi down to lo) seen earlier, its most recent occurrence, the k tokens after it."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
