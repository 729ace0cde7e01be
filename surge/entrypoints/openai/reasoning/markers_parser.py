"""Splits one choice's text, as it streams, into the reasoning between a start and an end marker and the answer
after it. A model that does not open with the start marker answers at once (Qwen3 with thinking off), unless its
template opened the reasoning in the prompt (DeepSeek-R1: the output starts inside it; DeepSeek V3.1 / V4: when the
prompt ends inside it, `prompt_opened`)."""
from __future__ import annotations

from surge.entrypoints.openai.markers import held_back
from surge.structured_output.reasoning import ReasoningMarkers

_START, _REASONING, _AFTER_END, _CONTENT = range(4)


class MarkerReasoningParser:
    def __init__(self, markers: ReasoningMarkers, prompt_opened: bool = False) -> None:
        self.markers = markers
        self.starts_inside = markers.starts_inside or prompt_opened
        # A template that decides in the prompt and did not open the reasoning: all of the output is the answer.
        self.state = _CONTENT if markers.prompt_decides and not prompt_opened else _START
        self.pending = ""
        self.reasoned = False  # the output opened (or began inside) its reasoning

    def reasoning_tokens(self, token_ids: list[int], tokenizer) -> int:
        """How many of the output's tokens are reasoning, its closing marker included (all of them when the output
        ended inside it): the shortest prefix whose text holds the end marker, found by bisection, so the count
        is exact whatever the tokenizer makes of the marker. A reasoning that an answer marker ended (V4's tool
        calls) counts up to that marker, less the marker's own tokens. 0 without reasoning."""
        if not self.reasoned or not token_ids:
            return 0
        text = tokenizer.decode(token_ids, skip_special_tokens=False)
        ends = [(text.find(m), m) for m in (self.markers.end, *self.markers.answer_starts) if m in text]
        if not ends:
            return len(token_ids)
        end = min(ends)[1]

        def has_end(n: int) -> bool:
            return end in tokenizer.decode(token_ids[:n], skip_special_tokens=False)
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if has_end(mid) else (mid + 1, hi)
        if end != self.markers.end:
            lo -= len(tokenizer.encode(end, add_special_tokens=False))
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
                    self.state = _REASONING if self.starts_inside else _CONTENT
                    self.reasoned = self.starts_inside
            elif self.state == _REASONING:
                found, marker = self._first_end(buf)
                if found >= 0:
                    reasoning.append(buf[:found])
                    if marker == end:
                        buf, self.state = buf[found + len(end):], _AFTER_END
                    else:  # an answer marker: it begins the answer
                        buf, self.state = buf[found:], _CONTENT
                    continue
                keep = 0 if final else max(held_back(buf, m) for m in (end, *self.markers.answer_starts))
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

    def _first_end(self, buf: str) -> tuple[int, str]:
        """Where the reasoning ends in buf (the end marker or an answer marker, whichever comes first), -1 if not."""
        found = [(i, m) for m in (self.markers.end, *self.markers.answer_starts) if (i := buf.find(m)) >= 0]
        return min(found) if found else (-1, "")
