"""Splits one choice's text, as it streams, into the reasoning between a start and an end marker and the answer
after it. A model that does not open with the start marker answers at once (Qwen3 with thinking off), unless its
template opened the reasoning in the prompt (DeepSeek-R1: the output starts inside it)."""
from __future__ import annotations

from surge.entrypoints.openai.markers import held_back
from surge.structured_output.reasoning import ReasoningMarkers

_START, _REASONING, _AFTER_END, _CONTENT = range(4)


class MarkerReasoningParser:
    def __init__(self, markers: ReasoningMarkers) -> None:
        self.markers = markers
        self.state = _START
        self.pending = ""

    @property
    def reasoning_ended(self) -> bool:
        return self.state in (_AFTER_END, _CONTENT)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of this piece of text; `final`: the choice ends here, nothing is held back."""
        start, end = self.markers.start, self.markers.end
        buf, reasoning, content = self.pending + text, [], []
        while True:
            if self.state == _START:
                head = buf.lstrip()
                if head.startswith(start):
                    buf, self.state = head[len(start):], _REASONING
                elif start.startswith(head) and not final:
                    break  # still undecided ("" or "<thi")
                else:
                    self.state = _REASONING if self.markers.starts_inside else _CONTENT
            elif self.state == _REASONING:
                found = buf.find(end)
                if found >= 0:
                    reasoning.append(buf[:found])
                    buf, self.state = buf[found + len(end):], _AFTER_END
                    continue
                keep = 0 if final else held_back(buf, end)
                reasoning.append(buf[:len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
            elif self.state == _AFTER_END:  # the answer starts after the blank lines that follow the marker
                buf = buf.lstrip()
                if buf or final:
                    self.state = _CONTENT
                    continue
                break
            else:
                content.append(buf)
                buf = ""
                break
        self.pending = buf
        return "".join(reasoning), "".join(content)
