"""Tool parsers: a model's own tool-call format -> OpenAI `tool_calls` (`--tool-call-parser NAME`, for tool_choice
"auto"), and the formats the grammar forces for "required" and a named function (forced.py)."""
from __future__ import annotations

import functools
from collections.abc import Callable

from surge.entrypoints.openai.tool_parsers.base import (ParsedDelta, ToolCall, ToolCallDelta, ToolParser,
                                                        merge_calls)
from surge.entrypoints.openai.tool_parsers.deepseek import DeepSeekToolParser
from surge.entrypoints.openai.tool_parsers.dsml import DsmlToolParser
from surge.entrypoints.openai.tool_parsers.hermes import HermesToolParser

# Name (vLLM's) -> a new parser for one choice. Qwen2.5 / Qwen3 / QwQ write Hermes's format; DeepSeek V3 / R1, V3.1,
# V3.2 and V4 each their own.
TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "deepseek_v3": functools.partial(DeepSeekToolParser, name_in_head=False),
    "deepseek_v31": functools.partial(DeepSeekToolParser, name_in_head=True),
    "deepseek_v32": functools.partial(DsmlToolParser, "function_calls"),
    "deepseek_v4": functools.partial(DsmlToolParser, "tool_calls"),
}

__all__ = ["TOOL_PARSERS", "ParsedDelta", "ToolCall", "ToolCallDelta", "ToolParser", "merge_calls"]
