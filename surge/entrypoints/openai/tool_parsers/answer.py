"""The answer's text around a model's tool calls: blanks next to a call separate it from the text and are not part
of the answer; blanks inside the text are, so they are held back until more text shows which they are."""
from __future__ import annotations

from surge.entrypoints.openai.tool_parsers.base import ParsedDelta


class AnswerText:
    def __init__(self) -> None:
        self.blanks = ""  # blanks held back: dropped next to a call, else given out before more text
        self.after_call = False  # no answer text since the last call closed

    def add(self, out: ParsedDelta, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            out.content += self.blanks + body
            self.blanks = text[len(body):]
            self.after_call = False
        else:
            self.blanks += text

    def call_starts(self) -> str:
        """The blanks before a call, dropped (given back by the caller should the call turn out not to be one)."""
        blanks, self.blanks = self.blanks, ""
        return blanks

    def finish(self) -> None:
        self.blanks = ""
