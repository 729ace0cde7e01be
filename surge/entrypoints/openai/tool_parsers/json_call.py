"""One tool call written as a JSON object, `{"name": "f", "arguments": {...}}`, read character by character as it
streams: the name as soon as its string closes, then the arguments' JSON text as it arrives (trailing blanks held
back), without waiting for the object to close. Only the top level is tracked; nested values are skipped over."""
from __future__ import annotations

import json

_KEY, _COLON, _VALUE = range(3)


class JsonCallScanner:
    def __init__(self, name_keys: tuple[str, ...] = ("name",),
                 arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.name_keys, self.arguments_keys = name_keys, arguments_keys
        self.text = ""  # the object's characters so far
        self.depth = 0
        self.in_string = self.escape = False
        self.phase = _KEY
        self.key: str | None = None
        self.key_start = self.value_start = -1
        self.name: str | None = None
        self.arguments_span: tuple[int, int | None] | None = None  # (start, end or None while open)
        self.arguments_sent = 0  # characters of the arguments' text given out
        self.name_sent = False
        self.done = False  # the object closed
        self.failed = False  # not a JSON object

    def feed(self, text: str) -> int:
        """Reads up to the end of the object; returns how many characters of `text` belong to it."""
        for i, c in enumerate(text):
            if self.done or self.failed:
                return i
            self.text += c
            self._step(c, len(self.text) - 1)
        return len(text)

    def _step(self, c: str, at: int) -> None:
        if self.depth == 0:
            if c == "{":
                self.depth = 1
            elif not c.isspace():
                self.failed = True
            return
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1 and self.phase == _KEY and self.key_start >= 0:
                    self.key = _loads(self.text[self.key_start:at + 1])
                    self.phase, self.key_start = _COLON, -1
            return
        top = self.depth == 1
        if c == '"':
            self.in_string = True
            if top and self.phase == _KEY:
                self.key_start = at
            elif top and self.phase == _VALUE:
                self._value_starts(at)
        elif c in "{[":
            if top and self.phase == _VALUE:
                self._value_starts(at)
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                if self.phase == _VALUE:
                    self._value_ends(at)
                self.done = True
        elif top:
            if c == ":" and self.phase == _COLON:
                self.phase, self.value_start = _VALUE, -1
            elif c == "," and self.phase == _VALUE:
                self._value_ends(at)
                self.phase = _KEY
            elif not c.isspace() and self.phase == _VALUE:
                self._value_starts(at)  # a number or a literal

    def _value_starts(self, at: int) -> None:
        if self.value_start < 0:
            self.value_start = at
            if self.key in self.arguments_keys and self.arguments_span is None:
                self.arguments_span = (at, None)

    def _value_ends(self, at: int) -> None:
        if self.value_start < 0:
            return
        value = self.text[self.value_start:at].rstrip()
        if self.key in self.name_keys and self.name is None:
            name = _loads(value)
            self.name = name if isinstance(name, str) else None
        if self.arguments_span is not None and self.arguments_span[1] is None:
            self.arguments_span = (self.value_start, self.value_start + len(value))
        self.value_start = -1

    def arguments_delta(self) -> str:
        """Arguments text not given out yet: all of it once the value closed, else up to its trailing blanks. A
        value written as a JSON string (arguments encoded twice) is given out whole, decoded, when it closes."""
        if self.arguments_span is None:
            return ""
        start, end = self.arguments_span
        if self.text[start] == '"':
            if end is None or self.arguments_sent:
                return ""
            decoded = _loads(self.text[start:end])
            text = decoded if isinstance(decoded, str) else self.text[start:end]
            self.arguments_sent = len(text) or 1
            return text
        visible = self.text[start:end] if end is not None else self.text[start:].rstrip()
        delta = visible[self.arguments_sent:]
        self.arguments_sent = len(visible)
        return delta


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
