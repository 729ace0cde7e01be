"""POST /v1/responses: OpenAI's Responses API, stateless. `input` is a string or a list of messages and items
(function calls and their outputs included), `instructions` a leading system message; the output is a list of
items (reasoning, a message, function calls); streaming sends the event sequence OpenAI's clients parse.
"""
from __future__ import annotations

from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from surge.entrypoints.openai import structured
from surge.entrypoints.openai.choice_output import ParsedChoice
from surge.entrypoints.openai.content import ImagePart, content_text
from surge.entrypoints.openai.errors import bad_request
from surge.entrypoints.openai.responses_stream import stream_events
from surge.entrypoints.openai.protocol import (FunctionCallItem, IncompleteDetails, InputTokensDetails,
                                               OutputMessage, OutputText, OutputTokensDetails, ReasoningItem,
                                               ReasoningText, ResponseObject, ResponsesRequest, ResponseUsage,
                                               TokenLogprob)
from surge.entrypoints.openai.serving import OpenAIServing, encode, now, random_id, shown_logprobs, token_logprobs
from surge.entrypoints.openai.tools import parse_tools, template_tool_calls
from surge.outputs import CompletionOutput
from surge.sampling_params import SamplingParams

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesHandler:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def conversation(self, req: ResponsesRequest, images: list[ImagePart] | None = None) -> list[dict]:
        """The request as chat-template messages: instructions first, then the input's messages and items. images:
        a multimodal model's list, which takes the `input_image` parts (see content_text)."""
        s = self.serving
        placeholder = s.engine.input_processor.image_placeholder() if images is not None else ""
        messages = [s.message("system", req.instructions, "instructions")] if req.instructions is not None else []
        if isinstance(req.input, str):
            return messages + [s.message("user", req.input, "input")]
        for i, item in enumerate(req.input):
            param = f"input[{i}]"
            if not isinstance(item, dict):
                raise bad_request(f"{param} must be an object (a message or an item)", param=param)
            item_type = item.get("type", "message")
            if item_type == "message":
                if not isinstance(item.get("role"), str):
                    raise bad_request(f"{param}.role must be a string", param=f"{param}.role")
                messages.append(s.message(item["role"], item.get("content"), param, images, placeholder))
            elif item_type == "function_call":
                messages.append(self._function_call(item, param, messages))
            elif item_type == "function_call_output":
                call_id = _string(item, "call_id", param)
                output = item.get("output")
                text = output if isinstance(output, str) else content_text(output, f"{param}.output")
                messages.append({"role": "tool", "content": text, "tool_call_id": call_id})
            elif item_type != "reasoning":  # earlier reasoning is not rendered again, as chat templates do
                raise bad_request(f"{param}: input items of type {item_type!r} are not supported; messages, "
                                  "function_call, function_call_output and reasoning are", param=f"{param}.type",
                                  code="unsupported_item_type")
        return [m for m in messages if m is not None]

    @staticmethod
    def _function_call(item: dict, param: str, messages: list[dict]) -> dict | None:
        """An earlier call as an assistant message's tool call; calls in a row are one message's calls."""
        call = {"id": _string(item, "call_id", param), "type": "function",
                "function": {"name": _string(item, "name", param), "arguments": item.get("arguments", "{}")}}
        [converted] = template_tool_calls([call], f"{param}")
        if messages and messages[-1].get("role") == "assistant" and messages[-1].get("tool_calls"):
            messages[-1]["tool_calls"].append(converted)
            return None
        return {"role": "assistant", "content": "", "tool_calls": [converted]}

    async def create(self, req: ResponsesRequest, http: HTTPRequest) -> Response:
        s = self.serving
        model = s.check_model(req.model)
        if req.previous_response_id is not None:
            raise bad_request("previous_response_id is not supported: this server is stateless; send the whole "
                              "conversation as input", param="previous_response_id")
        tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls, responses=True,
                            auto_enabled=s.options.enable_auto_tool_choice)
        constraint, grammar_param = structured.one_constraint(
            text_format=structured.text_format(req.text),
            structured_outputs=structured.extra_structured_outputs(req.structured_outputs),
            tool_choice=tools.structured_outputs() if tools is not None else None)
        images = s.image_parts()
        token_ids, mm_features = await s.render_images(self.conversation(req, images), images or [],
                                                       tools=tools.template_tools if tools is not None else None,
                                                       param="input")
        max_tokens = s.check_lengths(len(token_ids), req.max_output_tokens, "max_output_tokens", "input")
        params = s.sampling_params(req, max_tokens=max_tokens, logprobs=self._num_logprobs(req),
                                   structured_outputs=constraint)
        response_id = random_id("resp_")
        if req.stream:
            outputs = await s.start(token_ids, params, response_id, lora_request=s.lora_request(model),
                                    mm_features=mm_features, grammar_param=grammar_param)
            return StreamingResponse(stream_events(self, req, model, response_id, token_ids, params, outputs,
                                                   s.output_parser(tools, token_ids), grammar_param),
                                     media_type="text/event-stream")
        [out] = await s.run_to_end(http, [(token_ids, params)], response_id, grammar_param, s.lora_request(model),
                                   mm_features)
        c = out.outputs[0]
        parser = s.output_parser(tools, token_ids)
        output = output_items(parser.parse(c.text), _item_status(c.finish_reason), self._logprobs(c, params))
        response = self._response(req, model, response_id, "completed", output)
        self._finish(response, len(token_ids), len(c.token_ids), out.num_cached_tokens, c.finish_reason,
                     parser.reasoning_tokens(list(c.token_ids), s.tokenizer))
        response.kv_transfer_params = out.kv_transfer_params
        return Response(encode(response), media_type="application/json")

    def _num_logprobs(self, req: ResponsesRequest) -> int | None:
        if req.top_logprobs is not None:
            self.serving.limits.check_logprobs(req.top_logprobs, "top_logprobs")
        if LOGPROBS_INCLUDE not in (req.include or []):
            return None
        return req.top_logprobs or 0

    def _logprobs(self, c: CompletionOutput, params: SamplingParams) -> list[TokenLogprob]:
        """The output text's tokens (a hidden stop token left out), each with its top params.logprobs."""
        if params.logprobs is None or c.logprobs is None:
            return []
        return token_logprobs(shown_logprobs(c, params, self.serving.tokenizer), params.logprobs)

    def _response(self, req: ResponsesRequest, model: str, response_id: str, status: str,
                  output: list) -> ResponseObject:
        text = req.text if isinstance(req.text, dict) and req.text.get("format") else {"format": {"type": "text"}}
        return ResponseObject(id=response_id, created_at=now(), model=model, status=status, output=output,
                              instructions=req.instructions, max_output_tokens=req.max_output_tokens,
                              temperature=req.temperature, top_p=req.top_p, metadata=req.metadata,
                              parallel_tool_calls=req.parallel_tool_calls is not False,
                              tool_choice=req.tool_choice if req.tool_choice is not None else
                              ("auto" if req.tools else "none"), tools=req.tools or [], text=text, store=False)

    @staticmethod
    def _finish(response: ResponseObject, num_input: int, num_output: int, num_cached: int,
                finish_reason: str | None, num_reasoning: int = 0) -> None:
        response.usage = ResponseUsage(num_input, num_output, num_input + num_output,
                                       InputTokensDetails(num_cached), OutputTokensDetails(num_reasoning))
        if finish_reason == "length":
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails("max_output_tokens")
        else:
            response.status = "completed"


def output_items(parsed: ParsedChoice, status: str, logprobs: list[Any]) -> list:
    """Reasoning, then the message (when there is text, or nothing else), then the function calls."""
    items: list = []
    if parsed.reasoning is not None:
        items.append(ReasoningItem(random_id("rs_"), [ReasoningText(parsed.reasoning)], status=status))
    if parsed.content is not None or not parsed.tool_calls:
        items.append(OutputMessage(random_id("msg_"), status, [OutputText(parsed.content or "", logprobs=logprobs)]))
    for call in parsed.tool_calls:
        items.append(FunctionCallItem(random_id("fc_"), call.id, call.name, call.arguments, status=status))
    return items


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{key} must be a string", param=f"{param}.{key}")
    return value


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"
