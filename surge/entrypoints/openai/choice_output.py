"""One choice's generated text as the API returns it: reasoning apart (`--reasoning-parser`), then tool calls out of
the answer (the model's own format for tool_choice "auto", the forced one for "required" or a named function).
The same parser serves a stream, piece by piece, and a whole output, in one piece, so both say the same."""
from __future__ import annotations

from dataclasses import dataclass, field

from surge.entrypoints.openai.reasoning import REASONING_PARSERS
from surge.entrypoints.openai.tool_parsers import ToolCall, ToolCallDelta, merge_calls
from surge.entrypoints.openai.tools import ToolRequest


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ParsedChoice:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChoiceOutputParser:
    def __init__(self, reasoning_parser: str | None, tools: ToolRequest | None, tool_call_parser: str | None,
                 prompt_opened_reasoning: bool = False) -> None:
        """prompt_opened_reasoning: the rendered prompt ends inside the reasoning (see MarkerReasoningParser)."""
        self.reasoning = (REASONING_PARSERS[reasoning_parser](prompt_opened=prompt_opened_reasoning)
                          if reasoning_parser else None)
        self.tools = tools.parser(tool_call_parser) if tools is not None else None
        self.single_call = tools is not None and not tools.parallel
        self.named = tools is not None and tools.choice == "function"
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> ChoiceDelta:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        if self.tools is None or (self.reasoning is not None and not self.reasoning.reasoning_ended and not content):
            return ChoiceDelta(reasoning, content)
        parsed = self.tools.feed(content, final)
        # parallel_tool_calls=false: the first call only (the grammar of "required" already allows only one)
        calls = [d for d in parsed.tool_calls if not self.single_call or d.index == 0]
        self.num_calls = max([self.num_calls] + [d.index + 1 for d in calls])
        return ChoiceDelta(reasoning, parsed.content, calls)

    def parse(self, text: str) -> ParsedChoice:
        """A whole output at once."""
        d = self.feed(text, final=True)
        return ParsedChoice(d.reasoning if self.reasoning is not None and d.reasoning else None,
                            d.content if d.content or (self.tools is None and self.reasoning is None) else None,
                            merge_calls(d.tool_calls))

    def reasoning_tokens(self, token_ids: list[int], tokenizer) -> int:
        """Of the output's tokens (every one, once it is whole), how many are reasoning: 0 without a parser."""
        return self.reasoning.reasoning_tokens(token_ids, tokenizer) if self.reasoning is not None else 0

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling tools of its own choice."""
        if finish_reason == "stop" and self.num_calls and not self.named:
            return "tool_calls"
        return finish_reason
