"""DeepSeek V3.2 / V4 tool calls in DSML, their markup:

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">[1, 2]</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

(V3.2 names the block `function_calls`.) A parameter with string="true" is raw text, one with string="false" JSON;
the arguments are the JSON object of them, `{"city": "Paris", "days": [1, 2]}`, written as DeepSeek's reference
decoder writes it, and streamed as the values arrive. Text before and after the block is the answer."""
from __future__ import annotations

import json
import re

from surge.entrypoints.openai.markers import held_back
from surge.entrypoints.openai.tool_parsers.answer import AnswerText
from surge.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, tool_call_id

DSML = "｜DSML｜"
INVOKE, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAMETER, PARAMETER_END = f"<{DSML}parameter", f"</{DSML}parameter>"
_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>')
_PARAMETER = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>')

_TEXT, _BLOCK, _CALL, _VALUE = range(4)


class DsmlToolParser:
    def __init__(self, block: str) -> None:
        self.start, self.end = f"<{DSML}{block}>", f"</{DSML}{block}>"
        self.state = _TEXT
        self.pending = ""
        self.answer = AnswerText()
        self.num_calls = 0
        self.num_parameters = 0  # of the open call
        self.string = False  # the open parameter is raw text (its JSON string is being written)

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        buf = self.pending + text
        while buf:
            if self.state == _TEXT:
                found = buf.find(self.start)
                keep = 0 if final or found >= 0 else held_back(buf, self.start)
                self.answer.add(out, buf[:found] if found >= 0 else buf[:len(buf) - keep])
                if found < 0:
                    buf = buf[len(buf) - keep:]
                    break
                self.answer.call_starts()
                buf, self.state = buf[found + len(self.start):], _BLOCK
            elif self.state == _VALUE:
                found = buf.find(PARAMETER_END)
                keep = 0 if final or found >= 0 else held_back(buf, PARAMETER_END)
                value = buf[:found] if found >= 0 else buf[:len(buf) - keep]
                self._arguments(out, json.dumps(value, ensure_ascii=False)[1:-1] if self.string else value)
                if found < 0:
                    buf = buf[len(buf) - keep:]
                    break
                self._arguments(out, '"' if self.string else "")
                buf, self.state = buf[found + len(PARAMETER_END):], _CALL
            else:
                buf = buf.lstrip()
                rest = self._tag(out, buf, final)
                if rest is None:
                    break
                buf = rest
        self.pending = buf
        if final:
            self.answer.finish()
        return out

    def _tag(self, out: ParsedDelta, buf: str, final: bool) -> str | None:
        """Reads the tag buf starts with, inside the block or a call; None: wait for more text."""
        if self.state == _BLOCK:
            tags = {INVOKE: _INVOKE, self.end: None}
        else:
            tags = {PARAMETER: _PARAMETER, INVOKE_END: None}
        for tag, pattern in tags.items():
            if not buf.startswith(tag):
                if tag.startswith(buf) and not final:
                    return None
                continue
            if pattern is None:  # the block's or the call's end
                if self.state == _BLOCK:
                    self.state, self.answer.after_call = _TEXT, True
                else:
                    self._arguments(out, "}" if self.num_parameters else "{}")
                    self.num_calls, self.state = self.num_calls + 1, _BLOCK
                return buf[len(tag):]
            match = pattern.match(buf)
            if match is None:
                return None if ">" not in buf and not final else self._skip(buf)
            if self.state == _BLOCK:
                out.tool_calls.append(ToolCallDelta(self.num_calls, tool_call_id(), match.group(1)))
                self.state, self.num_parameters = _CALL, 0
            else:
                name, self.string = match.group(1), match.group(2) == "true"
                head = ("{" if not self.num_parameters else ", ") + json.dumps(name, ensure_ascii=False) + ": "
                self._arguments(out, head + ('"' if self.string else ""))
                self.state, self.num_parameters = _VALUE, self.num_parameters + 1
            return buf[match.end():]
        return self._skip(buf)

    @staticmethod
    def _skip(buf: str) -> str:
        """Text that is not the markup where markup must be: skipped up to the next tag."""
        following = buf.find("<", 1)
        return buf[following:] if following > 0 else ""

    def _arguments(self, out: ParsedDelta, text: str) -> None:
        if text:
            out.tool_calls.append(ToolCallDelta(self.num_calls, arguments=text))
