"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them, text
around them being the answer. A call is given out once its name is read; a region that never yields a name (not
JSON, no name) is given back as text, as the model wrote it."""
from __future__ import annotations

from surge.entrypoints.openai.markers import held_back
from surge.entrypoints.openai.tool_parsers.answer import AnswerText
from surge.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, tool_call_id
from surge.entrypoints.openai.tool_parsers.json_call import JsonCallScanner

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser:
    def __init__(self) -> None:
        self.pending = ""  # text not classified yet
        self.answer = AnswerText()
        self.in_call = False
        self.region = ""  # raw text of the call being read, given back as text if it never names a function
        self.scanner: JsonCallScanner | None = None
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        buf = self.pending + text
        while buf:
            if not self.in_call:
                found = buf.find(START)
                if found < 0:
                    keep = 0 if final else held_back(buf, START)
                    self.answer.add(out, buf[:len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                self.answer.add(out, buf[:found])
                buf = buf[found + len(START):]
                # Blanks before a call are not part of the answer, unless the call turns out not to be one.
                self.in_call, self.region, self.scanner = True, self.answer.call_starts() + START, JsonCallScanner()
            else:
                found = buf.find(END)
                keep = 0 if final or found >= 0 else held_back(buf, END)
                body = buf[:found] if found >= 0 else buf[:len(buf) - keep]
                self.region += body
                self.scanner.feed(body)
                self._call(out)
                if found < 0:
                    buf = buf[len(buf) - keep:]
                    break
                self._close_call(out, END)
                buf = buf[found + len(END):]
        self.pending = buf
        if final:
            if self.in_call:
                self._close_call(out, "")
            self.answer.finish()
        return out

    def _call(self, out: ParsedDelta) -> None:
        s = self.scanner
        if s.name is None:
            return
        index = self.num_calls
        if not s.name_sent:
            s.name_sent = True
            out.tool_calls.append(ToolCallDelta(index, tool_call_id(), s.name))
        arguments = s.arguments_delta()
        if arguments:
            out.tool_calls.append(ToolCallDelta(index, arguments=arguments))

    def _close_call(self, out: ParsedDelta, end: str) -> None:
        s = self.scanner
        self._call(out)
        if s.name_sent:
            if not s.arguments_sent:
                out.tool_calls.append(ToolCallDelta(self.num_calls, arguments="{}"))
            self.num_calls += 1
            self.answer.after_call = True
        else:
            self.answer.add(out, self.region + end)  # not a call after all
        self.in_call, self.region, self.scanner = False, "", None
