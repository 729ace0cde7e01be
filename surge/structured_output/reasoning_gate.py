"""The reasoning gate of one request: while the output is inside the model's reasoning its grammar waits (the mask
allows everything); the tokens after the closing marker are the ones the grammar constrains."""
from __future__ import annotations

from surge.structured_output.reasoning import ReasoningMarkers


def _index(tokens: list[int], pattern: list[int], last: bool = False) -> int:
    """Start of the first (or last) occurrence of pattern in tokens, -1 when absent."""
    n = len(pattern)
    starts = range(len(tokens) - n, -1, -1) if last else range(len(tokens) - n + 1)
    return next((i for i in starts if tokens[i:i + n] == pattern), -1)


def _marker_ids(markers: ReasoningMarkers, tokenizer) -> tuple[list[int], list[int]]:
    return tuple(tokenizer.encode(text, add_special_tokens=False) for text in (markers.start, markers.end))


def prompt_opens_reasoning(markers: ReasoningMarkers, tokenizer, prompt_token_ids: list[int]) -> bool:
    """The prompt's last start marker comes after its last end marker (or it has no end marker): a template that
    opens the reasoning in the prompt (`<｜Assistant｜><think>`), so the output begins inside it."""
    start_ids, end_ids = _marker_ids(markers, tokenizer)
    start = _index(prompt_token_ids, start_ids, last=True) if start_ids else -1
    return start >= 0 and start > _index(prompt_token_ids, end_ids, last=True)


class ReasoningGate:
    def __init__(self, start_ids: list[int], end_ids: list[int], prompt_token_ids: list[int],
                 prompt_decides: bool = False) -> None:
        assert end_ids, "the closing marker must tokenize to at least one token"
        self.end_ids = end_ids
        last_start = _index(prompt_token_ids, start_ids, last=True) if start_ids else -1
        last_end = _index(prompt_token_ids, end_ids, last=True)
        if prompt_decides:  # reasoning only when the prompt left it open
            self.open = not (last_start >= 0 and last_start > last_end)
        else:  # open from the start when the prompt already closed the reasoning (an empty <think></think>)
            self.open = last_end >= 0 and last_end > last_start
        self._tail: list[int] = []  # the last len(end_ids) - 1 output tokens: a marker may span two steps

    @staticmethod
    def for_request(markers: ReasoningMarkers, tokenizer, prompt_token_ids: list[int]) -> ReasoningGate:
        start, end = _marker_ids(markers, tokenizer)
        return ReasoningGate(start, end, prompt_token_ids, markers.prompt_decides)

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
