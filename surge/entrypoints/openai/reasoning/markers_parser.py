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
        self.reasoned = False  # the output opened (or began inside) its reasoning

    def reasoning_tokens(self, token_ids: list[int], tokenizer) -> int:
        """How many of the output's tokens are reasoning, its closing marker included (all of them when the output
        ended inside it): the shortest prefix whose text holds the end marker, found by bisection, so the count
        is exact whatever the tokenizer makes of the marker. 0 without reasoning."""
        end = self.markers.end
        def has_end(n: int) -> bool:
            return end in tokenizer.decode(token_ids[:n], skip_special_tokens=False)
        if not self.reasoned or not token_ids:
            return 0
        if not has_end(len(token_ids)):
            return len(token_ids)
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if has_end(mid) else (mid + 1, hi)
        return lo

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
                    buf, self.state, self.reasoned = head[len(start):], _REASONING, True
                elif start.startswith(head) and not final:
                    break  # still undecided ("" or "<thi")
                else:
                    self.state = _REASONING if self.markers.starts_inside else _CONTENT
                    self.reasoned = self.markers.starts_inside
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
