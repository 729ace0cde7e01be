"""The Responses API's event stream: response.created, then each output item (reasoning, the message, function
calls) added, its deltas, done; then response.completed (or .incomplete), numbered in sequence as OpenAI's clients
expect. Items open in the order the choice's parser gives out their text."""
from __future__ import annotations

from collections.abc import AsyncIterator

from surge.entrypoints.openai.choice_output import ChoiceDelta, ChoiceOutputParser
from surge.entrypoints.openai.protocol import (FunctionCallItem, OutputMessage, OutputText, ReasoningItem,
                                               ReasoningText, ResponseEvent, ResponsesRequest)
from surge.entrypoints.openai.serving import encode, engine_error, random_id, sse
from surge.sampling_params import SamplingParams


class _Items:
    """The output items of one streamed response, and the events that build them."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list = []  # closed items, by output index
        self.kind: str | None = None  # the open item: reasoning | message | call
        self.item_id = ""
        self.text = ""  # the open item's text (or arguments)
        self.call: tuple[str, str] | None = None  # the open call's (call_id, name)
        self.call_index = -1
        self.logprobs: list = []  # of the message's text; those of held-back text go with it
        self.logprobs_sent = 0

    def event(self, type: str, **fields) -> bytes:
        self.sequence += 1
        return sse(encode(ResponseEvent(type=type, sequence_number=self.sequence - 1, **fields)), event=type)

    @property
    def index(self) -> int:
        return len(self.items)

    def _where(self, content: bool = True) -> dict:
        where = dict(item_id=self.item_id, output_index=self.index)
        return {**where, "content_index": 0} if content else where

    def open(self, kind: str, call: tuple[str, str] | None = None) -> list[bytes]:
        out = self.close("completed") if self.kind is not None else []
        self.kind, self.text, self.call = kind, "", call
        if kind == "reasoning":
            self.item_id = random_id("rs_")
            out.append(self.event("response.output_item.added", output_index=self.index,
                                  item=ReasoningItem(self.item_id, [], status="in_progress")))
        elif kind == "message":
            self.item_id = random_id("msg_")
            out.append(self.event("response.output_item.added", output_index=self.index,
                                  item=OutputMessage(self.item_id, "in_progress", [])))
            out.append(self.event("response.content_part.added", part=OutputText(""), **self._where()))
        else:
            self.item_id = random_id("fc_")
            out.append(self.event("response.output_item.added", output_index=self.index,
                                  item=FunctionCallItem(self.item_id, call[0], call[1], "", status="in_progress")))
        return out

    def close(self, status: str) -> list[bytes]:
        text, out = self.text, []
        if self.kind == "reasoning":
            out.append(self.event("response.reasoning_text.done", text=text, **self._where()))
            item = ReasoningItem(self.item_id, [ReasoningText(text)], status=status)
        elif self.kind == "message":
            logprobs = self.logprobs
            out.append(self.event("response.output_text.done", text=text, logprobs=logprobs, **self._where()))
            out.append(self.event("response.content_part.done", part=OutputText(text, logprobs=logprobs),
                                  **self._where()))
            item = OutputMessage(self.item_id, status, [OutputText(text, logprobs=logprobs)])
        else:
            out.append(self.event("response.function_call_arguments.done", arguments=text, **self._where(False)))
            item = FunctionCallItem(self.item_id, self.call[0], self.call[1], text, status=status)
        out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.items.append(item)
        self.kind = None
        return out

    def add(self, delta: ChoiceDelta) -> list[bytes]:
        out = []
        if delta.reasoning:
            if self.kind != "reasoning":
                out += self.open("reasoning")
            self.text += delta.reasoning
            out.append(self.event("response.reasoning_text.delta", delta=delta.reasoning, **self._where()))
        if delta.content:
            if self.kind != "message":
                out += self.open("message")
            self.text += delta.content
            out.append(self.event("response.output_text.delta", delta=delta.content,
                                  logprobs=self.logprobs[self.logprobs_sent:], **self._where()))
            self.logprobs_sent = len(self.logprobs)
        for d in delta.tool_calls:
            if d.name is not None and d.index != self.call_index:
                out += self.open("call", (d.id, d.name))
                self.call_index = d.index
            if d.arguments and self.kind == "call":
                self.text += d.arguments
                out.append(self.event("response.function_call_arguments.delta", delta=d.arguments,
                                      **self._where(False)))
        return out


async def stream_events(handler, req: ResponsesRequest, model: str, response_id: str, token_ids: list[int],
                        params: SamplingParams, outputs: AsyncIterator, parser: ChoiceOutputParser,
                        grammar_param: str | None) -> AsyncIterator[bytes]:
    items = _Items()
    response = handler._response(req, model, response_id, "in_progress", [])
    yield items.event("response.created", response=response)
    yield items.event("response.in_progress", response=response)
    output_ids: list[int] = []
    try:
        async for out in outputs:
            c = out.outputs[0]
            output_ids += c.token_ids
            items.logprobs += handler._logprobs(c, params)
            for event in items.add(parser.feed(c.text, final=out.finished)):
                yield event
            if out.finished:
                status = "incomplete" if c.finish_reason == "length" else "completed"
                if items.kind is None and not items.items:  # nothing written: an empty message, as OpenAI
                    for event in items.open("message"):
                        yield event
                if items.kind is not None:
                    for event in items.close(status):
                        yield event
                response = handler._response(req, model, response_id, "completed", items.items)
                handler._finish(response, len(token_ids), len(output_ids), out.num_cached_tokens, c.finish_reason,
                                parser.reasoning_tokens(output_ids, handler.serving.tokenizer))
                # As OpenAI: a response cut by max_output_tokens ends with response.incomplete.
                done = "response.completed" if response.status == "completed" else "response.incomplete"
                yield items.event(done, response=response)
    except Exception as e:
        error = engine_error(e, grammar_param)
        yield items.event("error", code=error.code or error.type, message=error.message, param=error.param)
    finally:
        await outputs.aclose()  # a client gone mid-stream: abort
