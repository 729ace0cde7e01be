"""POST /v1/responses: OpenAI's Responses API, stateless. `input` is a string or a list of messages and items,
`instructions` a leading system message; streaming sends the event sequence OpenAI's clients parse.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from surge.entrypoints.openai.errors import bad_request
from surge.entrypoints.openai.protocol import (IncompleteDetails, InputTokensDetails, OutputMessage, OutputText,
                                               OutputTokensDetails, ResponseEvent, ResponseObject, ResponsesRequest,
                                               ResponseUsage, TokenLogprob)
from surge.entrypoints.openai.serving import (MAX_TOP_LOGPROBS, OpenAIServing, encode, engine_error, now, random_id,
                                              shown_logprobs, sse, token_logprobs)
from surge.outputs import CompletionOutput
from surge.sampling_params import SamplingParams

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesHandler:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def conversation(self, req: ResponsesRequest) -> list[dict]:
        """The request as chat-template messages: instructions first, then the input's messages."""
        s = self.serving
        messages = [s.message("system", req.instructions, "instructions")] if req.instructions is not None else []
        if isinstance(req.input, str):
            return messages + [s.message("user", req.input, "input")]
        for i, item in enumerate(req.input):
            param = f"input[{i}]"
            if not isinstance(item, dict):
                raise bad_request(f"{param} must be an object (a message or an item)", param=param)
            item_type = item.get("type", "message")
            if item_type != "message":
                raise bad_request(f"{param}: input items of type {item_type!r} are not supported yet; only messages "
                                  "are", param=f"{param}.type", code="unsupported_item_type")
            if not isinstance(item.get("role"), str):
                raise bad_request(f"{param}.role must be a string", param=f"{param}.role")
            messages.append(s.message(item["role"], item.get("content"), param))
        return messages

    async def create(self, req: ResponsesRequest, http: HTTPRequest) -> Response:
        s = self.serving
        model = s.check_model(req.model)
        if req.previous_response_id is not None:
            raise bad_request("previous_response_id is not supported: this server is stateless; send the whole "
                              "conversation as input", param="previous_response_id")
        if req.tools:
            raise bad_request("tools are not supported yet", param="tools")
        text_format = (req.text or {}).get("format") or {"type": "text"}
        if text_format.get("type") != "text":
            raise bad_request("text.format other than {'type': 'text'} is not supported yet", param="text.format")
        token_ids = s.render(self.conversation(req))
        max_tokens = s.check_lengths(len(token_ids), req.max_output_tokens, "max_output_tokens", "input")
        params = s.sampling_params(req, max_tokens=max_tokens, logprobs=self._num_logprobs(req))
        response_id = random_id("resp_")
        if req.stream:
            return StreamingResponse(self._stream(req, model, response_id, token_ids, params),
                                     media_type="text/event-stream")
        [out] = await s.run_to_end(http, [(token_ids, params)], response_id)
        c = out.outputs[0]
        message = OutputMessage(random_id("msg_"), _item_status(c.finish_reason),
                                [OutputText(c.text, logprobs=self._logprobs(c, params))])
        response = self._response(req, model, response_id, "completed", [message])
        self._finish(response, len(token_ids), len(c.token_ids), out.num_cached_tokens, c.finish_reason)
        response.kv_transfer_params = out.kv_transfer_params
        return Response(encode(response), media_type="application/json")

    @staticmethod
    def _num_logprobs(req: ResponsesRequest) -> int | None:
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs={req.top_logprobs} is invalid: must be in [0, {MAX_TOP_LOGPROBS}]",
                              param="top_logprobs")
        if LOGPROBS_INCLUDE not in (req.include or []):
            return None
        return req.top_logprobs or 0

    def _logprobs(self, c: CompletionOutput, params: SamplingParams) -> list[TokenLogprob]:
        """The output text's tokens (a hidden stop token left out), each with its top params.logprobs."""
        if params.logprobs is None or c.logprobs is None:
            return []
        return token_logprobs(shown_logprobs(c, params, self.serving.tokenizer), params.logprobs)

    def _response(self, req: ResponsesRequest, model: str, response_id: str, status: str,
                  output: list[OutputMessage]) -> ResponseObject:
        return ResponseObject(id=response_id, created_at=now(), model=model, status=status, output=output,
                              instructions=req.instructions, max_output_tokens=req.max_output_tokens,
                              temperature=req.temperature, top_p=req.top_p, metadata=req.metadata,
                              parallel_tool_calls=req.parallel_tool_calls, tool_choice=req.tool_choice,
                              store=False)

    @staticmethod
    def _finish(response: ResponseObject, num_input: int, num_output: int, num_cached: int,
                finish_reason: str | None) -> None:
        response.usage = ResponseUsage(num_input, num_output, num_input + num_output,
                                       InputTokensDetails(num_cached), OutputTokensDetails())
        if finish_reason == "length":
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails("max_output_tokens")
        else:
            response.status = "completed"

    async def _stream(self, req: ResponsesRequest, model: str, response_id: str, token_ids: list[int],
                      params: SamplingParams) -> AsyncIterator[bytes]:
        sequence = 0

        def event(type: str, **fields) -> bytes:
            nonlocal sequence
            sequence += 1
            return sse(encode(ResponseEvent(type=type, sequence_number=sequence - 1, **fields)), event=type)

        response = self._response(req, model, response_id, "in_progress", [])
        yield event("response.created", response=response)
        yield event("response.in_progress", response=response)
        item_id = random_id("msg_")
        where = dict(item_id=item_id, output_index=0, content_index=0)
        yield event("response.output_item.added", output_index=0,
                    item=OutputMessage(item_id, "in_progress", []))
        yield event("response.content_part.added", part=OutputText(""), **where)
        text, num_output = [], 0
        logprobs, num_sent = [], 0  # logprobs of the text so far; those of held-back text go with it
        try:
            async for out in self.serving.stream(token_ids, params, response_id):
                c = out.outputs[0]
                num_output += len(c.token_ids)
                logprobs += self._logprobs(c, params)
                if c.text:
                    text.append(c.text)
                    yield event("response.output_text.delta", delta=c.text, logprobs=logprobs[num_sent:], **where)
                    num_sent = len(logprobs)
                if out.finished:
                    full = "".join(text)
                    yield event("response.output_text.done", text=full, logprobs=logprobs, **where)
                    yield event("response.content_part.done", part=OutputText(full, logprobs=logprobs), **where)
                    message = OutputMessage(item_id, _item_status(c.finish_reason),
                                            [OutputText(full, logprobs=logprobs)])
                    yield event("response.output_item.done", output_index=0, item=message)
                    response = self._response(req, model, response_id, "completed", [message])
                    self._finish(response, len(token_ids), num_output, out.num_cached_tokens, c.finish_reason)
                    # As OpenAI: a response cut by max_output_tokens ends with response.incomplete.
                    done = "response.completed" if response.status == "completed" else "response.incomplete"
                    yield event(done, response=response)
        except Exception as e:
            error = engine_error(e)
            yield event("error", code=error.code or error.type, message=error.message, param=error.param)


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"
