"""Tool parsers: a model's own tool-call format -> OpenAI `tool_calls` (`--tool-call-parser NAME`, for tool_choice
"auto"), and the formats the grammar forces for "required" and a named function (forced.py)."""
from __future__ import annotations

from collections.abc import Callable

from surge.entrypoints.openai.tool_parsers.base import (ParsedDelta, ToolCall, ToolCallDelta, ToolParser,
                                                        merge_calls)
from surge.entrypoints.openai.tool_parsers.hermes import HermesToolParser

# Name -> a new parser for one choice. Qwen2.5 / Qwen3 / QwQ write Hermes's format.
TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}

__all__ = ["TOOL_PARSERS", "ParsedDelta", "ToolCall", "ToolCallDelta", "ToolParser", "merge_calls"]
