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
    # DeepSeek V3.1 / V4: the prompt decides. Their templates end a thinking-mode prompt with the start marker
    # (chat_template_kwargs {"thinking": true}; V4's default) and a chat-mode one with the end marker, so the output
    # is reasoning first only when the prompt left the reasoning open; otherwise all of it is the answer.
    prompt_decides: bool = False
    # Text that also ends the reasoning and begins the answer, kept in it: V4 may open its DSML tool calls straight
    # from its reasoning (only the server's parser reads this; the grammar still waits for the end marker).
    answer_starts: tuple[str, ...] = ()


REASONING_MARKERS: dict[str, ReasoningMarkers] = {
    "qwen3": ReasoningMarkers("<think>", "</think>"),
    "deepseek_r1": ReasoningMarkers("<think>", "</think>", starts_inside=True),
    "deepseek_v3": ReasoningMarkers("<think>", "</think>", prompt_decides=True),
    "deepseek_v4": ReasoningMarkers("<think>", "</think>", prompt_decides=True,
                                    answer_starts=("<｜DSML｜tool_calls>",)),
}
