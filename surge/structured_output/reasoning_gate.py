"""The reasoning gate of one request: while the output is inside the model's reasoning its grammar waits (the mask
allows everything); the tokens after the closing marker are the ones the grammar constrains."""
from __future__ import annotations

from surge.structured_output.reasoning import ReasoningMarkers


def _index(tokens: list[int], pattern: list[int], last: bool = False) -> int:
    """Start of the first (or last) occurrence of pattern in tokens, -1 when absent."""
    n = len(pattern)
    starts = range(len(tokens) - n, -1, -1) if last else range(len(tokens) - n + 1)
    return next((i for i in starts if tokens[i:i + n] == pattern), -1)


class ReasoningGate:
    def __init__(self, start_ids: list[int], end_ids: list[int], prompt_token_ids: list[int]) -> None:
        assert end_ids, "the closing marker must tokenize to at least one token"
        self.end_ids = end_ids
        # Open from the start when the prompt already closed the reasoning (a template that disables thinking
        # writes an empty <think></think> into the prompt).
        end = _index(prompt_token_ids, end_ids, last=True)
        self.open = end >= 0 and end > (_index(prompt_token_ids, start_ids, last=True) if start_ids else -1)
        self._tail: list[int] = []  # the last len(end_ids) - 1 output tokens: a marker may span two steps

    @staticmethod
    def for_request(markers: ReasoningMarkers, tokenizer, prompt_token_ids: list[int]) -> ReasoningGate:
        start, end = (tokenizer.encode(text, add_special_tokens=False) for text in (markers.start, markers.end))
        return ReasoningGate(start, end, prompt_token_ids)

    def feed(self, tokens: list[int]) -> list[int]:
        """Take new output tokens; return those the grammar must consume (the ones after the closing marker)."""
        if self.open:
            return tokens
        window = self._tail + tokens
        end = _index(window, self.end_ids)
        if end < 0:
            keep = len(self.end_ids) - 1
            self._tail = window[len(window) - keep:] if keep else []
            return []
        self.open, self._tail = True, []
        return window[end + len(self.end_ids):]
