"""The markers that open and close a model's reasoning text, per reasoning parser (`--reasoning-parser NAME`).

One table for both readers: the engine starts a request's grammar only after the closing marker, and the server's
reasoning parsers (surge/entrypoints/openai/reasoning/) split `reasoning_content` from the answer with them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningMarkers:
    start: str
    end: str
    # DeepSeek-R1's template opens the reasoning inside the prompt: its output may begin inside it, with no start.
    starts_inside: bool = False


REASONING_MARKERS: dict[str, ReasoningMarkers] = {
    "qwen3": ReasoningMarkers("<think>", "</think>"),
    "deepseek_r1": ReasoningMarkers("<think>", "</think>", starts_inside=True),
}
