"""DeepSeek V3 / R1 and V3.1 tool calls, written with the tokenizer's own marker tokens: a section
`<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>` of calls
`<｜tool▁call▁begin｜>HEAD<｜tool▁sep｜>BODY<｜tool▁call▁end｜>`.
V3 / R1 (`deepseek_v3`): HEAD is the call's type ("function"), BODY the name, a newline and the arguments in a
```json fence. V3.1 (`deepseek_v31`): HEAD is the name, BODY the arguments' JSON. A call is given out once its name is
read, its arguments as they arrive; text before and after the section is the answer."""
from __future__ import annotations

from surge.entrypoints.openai.markers import held_back
from surge.entrypoints.openai.tool_parsers.answer import AnswerText
from surge.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolCallDelta, tool_call_id

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCE = "```json"
_TRAILING = " \t\r\n`"  # after the arguments' JSON (which ends with } or ]): blanks and V3's closing fence

_TEXT, _SECTION, _HEAD, _BODY = range(4)


class DeepSeekToolParser:
    def __init__(self, name_in_head: bool) -> None:
        self.name_in_head = name_in_head  # V3.1: the name before the separator; V3: the type
        self.state = _TEXT
        self.pending = ""  # text not classified yet
        self.answer = AnswerText()
        self.head = self.body = ""  # of the open call
        self.name: str | None = None
        self.arguments_sent = 0
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        buf = self.pending + text
        while buf:
            if self.state == _TEXT:
                found = buf.find(CALLS_BEGIN)
                keep = 0 if final or found >= 0 else held_back(buf, CALLS_BEGIN)
                self.answer.add(out, buf[:found] if found >= 0 else buf[:len(buf) - keep])
                if found < 0:
                    buf = buf[len(buf) - keep:]
                    break
                self.answer.call_starts()
                buf, self.state = buf[found + len(CALLS_BEGIN):], _SECTION
            elif self.state == _SECTION:  # between calls: blanks, the next call, or the section's end
                buf = buf.lstrip()
                if buf.startswith(CALL_BEGIN):
                    buf, self.state, self.head, self.body = buf[len(CALL_BEGIN):], _HEAD, "", ""
                elif buf.startswith(CALLS_END):
                    buf, self.state, self.answer.after_call = buf[len(CALLS_END):], _TEXT, True
                elif not final and (CALL_BEGIN.startswith(buf) or CALLS_END.startswith(buf)):
                    break
                else:  # not the format: the rest of the section is given back as text
                    self.state = _TEXT
                    self.answer.add(out, buf)
                    buf = ""
            elif self.state == _HEAD:
                found = buf.find(SEP)
                keep = 0 if final or found >= 0 else held_back(buf, SEP)
                self.head += buf[:found] if found >= 0 else buf[:len(buf) - keep]
                if found < 0:
                    buf = buf[len(buf) - keep:]
                    break
                buf, self.state = buf[found + len(SEP):], _BODY
                if self.name_in_head:
                    self._start_call(out, self.head.strip())
            else:
                found = buf.find(CALL_END)
                keep = 0 if final or found >= 0 else held_back(buf, CALL_END)
                self.body += buf[:found] if found >= 0 else buf[:len(buf) - keep]
                self._arguments(out, closed=found >= 0 or final)
                if found < 0:
                    buf = buf[len(buf) - keep:]
                    break
                self._close_call(out)
                buf, self.state = buf[found + len(CALL_END):], _SECTION
        self.pending = buf
        if final:
            self.answer.finish()
        return out

    def _start_call(self, out: ParsedDelta, name: str) -> None:
        self.name, self.arguments_sent = name, 0
        out.tool_calls.append(ToolCallDelta(self.num_calls, tool_call_id(), name))

    def _arguments(self, out: ParsedDelta, closed: bool) -> None:
        body = self.body
        if not self.name_in_head:  # V3: the name's line, then the fenced arguments
            line_end = body.find("\n")
            if line_end < 0:
                if not closed:
                    return
                line_end = len(body)
            if self.name is None:
                self._start_call(out, body[:line_end].strip())
            body = body[line_end + 1:].lstrip()
            if not closed and _FENCE.startswith(body):
                return  # the fence is still arriving
            body = body.removeprefix(_FENCE)
        visible = body.strip().rstrip(_TRAILING)
        if len(visible) > self.arguments_sent:
            out.tool_calls.append(ToolCallDelta(self.num_calls, arguments=visible[self.arguments_sent:]))
            self.arguments_sent = len(visible)

    def _close_call(self, out: ParsedDelta) -> None:
        if not self.arguments_sent:
            out.tool_calls.append(ToolCallDelta(self.num_calls, arguments="{}"))
        self.num_calls += 1
        self.name = None
