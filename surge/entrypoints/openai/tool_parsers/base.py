"""What a tool parser gives back for each piece of a choice's text: the answer's text, and tool calls in pieces as
OpenAI streams them (a call's id and name first, then its arguments as JSON text, delta by delta)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    index: int  # the call's place among this choice's calls
    id: str | None = None  # with the name, in the call's first delta only
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(Protocol):
    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        """The next piece of the choice's text; `final`: the choice ends here, so nothing may be held back."""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


def merge_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Whole calls from their deltas, in index order."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(d.id or tool_call_id(), d.name or "", "")
        calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]
