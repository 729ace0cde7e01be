"""Tool calls the grammar forces (tool_choice "required" or a named function), so no model format is parsed:
"required" writes a JSON array of `{"name": ..., "parameters": {...}}`, a named function writes its arguments."""
from __future__ import annotations

from surge.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, tool_call_id
from surge.entrypoints.openai.tool_parsers.json_call import JsonCallScanner


class RequiredToolParser:
    """`[{"name": "f", "parameters": {...}}, ...]`, each element a call, streamed as it is written."""

    def __init__(self) -> None:
        self.scanner: JsonCallScanner | None = None
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        while text:
            if self.scanner is None:
                start = text.find("{")  # the grammar allows only "[", "," and blanks between elements
                if start < 0:
                    break
                text, self.scanner = text[start:], JsonCallScanner()
            text = text[self.scanner.feed(text):]
            self._call(out)
            if self.scanner.done:
                self.scanner = None
                self.num_calls += 1
        if final and self.scanner is not None:  # cut short (max_tokens): what was read of the last call
            self._call(out)
        return out

    def _call(self, out: ParsedDelta) -> None:
        s = self.scanner
        if s.name is None:
            return
        if not s.name_sent:
            s.name_sent = True
            out.tool_calls.append(ToolCallDelta(self.num_calls, tool_call_id(), s.name))
        arguments = s.arguments_delta()
        if arguments:
            out.tool_calls.append(ToolCallDelta(self.num_calls, arguments=arguments))
        if s.done and not s.arguments_sent:
            out.tool_calls.append(ToolCallDelta(self.num_calls, arguments="{}"))


class NamedToolParser:
    """The whole text is the named function's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        if not self.started:
            self.started = True
            out.tool_calls.append(ToolCallDelta(0, tool_call_id(), self.name))
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out
