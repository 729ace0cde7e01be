"""Finding a marker (`<think>`, `</tool_call>`) in text that arrives in pieces: a piece may end inside one."""
from __future__ import annotations


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`, and so must wait for more text."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
