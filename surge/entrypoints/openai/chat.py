"""POST /v1/chat/completions: a conversation rendered by the model's chat template, n samples, streamed or not;
structured output (`response_format`), tools and reasoning (`reasoning_content`) included."""
from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from surge.entrypoints.openai import structured
from surge.entrypoints.openai.choice_output import ChoiceDelta
from surge.entrypoints.openai.errors import bad_request
from surge.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                               ChatCompletionRequest, ChatCompletionResponse, ChoiceLogprobs,
                                               DeltaFunction, DeltaMessage, DeltaToolCall, FunctionCall,
                                               PromptTokensDetails, ToolCallObject, UsageInfo)
from surge.entrypoints.openai.serving import (OpenAIServing, encode, engine_error, now, random_id, shown_logprobs,
                                              sse, token_logprobs)
from surge.entrypoints.openai.tools import ToolRequest, parse_tools
from surge.multimodal import MultiModalFeature
from surge.outputs import CompletionOutput
from surge.sampling_params import SamplingParams


class ChatHandler:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def render_prompt(self, req: ChatCompletionRequest, tools: ToolRequest | None = None
                            ) -> tuple[list[int], list[MultiModalFeature]]:
        """Token ids, and the images of a multimodal model's conversation."""
        s = self.serving
        images = s.image_parts()
        return await s.render_images(s.chat_messages(req.messages, images=images), images or [],
                                     req.add_generation_prompt, req.chat_template_kwargs, req.chat_template,
                                     tools.template_tools if tools is not None else None)

    async def create(self, req: ChatCompletionRequest, http: HTTPRequest) -> Response:
        s = self.serving
        model = s.check_model(req.model)
        tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls, responses=False,
                            auto_enabled=s.options.enable_auto_tool_choice)
        constraint, grammar_param = structured.one_constraint(
            response_format=structured.response_format(req.response_format),
            structured_outputs=structured.extra_structured_outputs(req.structured_outputs),
            tool_choice=tools.structured_outputs() if tools is not None else None)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
        logprobs = None
        if req.logprobs:
            logprobs = req.top_logprobs or 0
            s.limits.check_logprobs(logprobs, "top_logprobs")
        elif req.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        token_ids, mm_features = await self.render_prompt(req, tools)
        if req.max_completion_tokens is not None:  # the newer name wins, and 0 is as invalid as max_tokens=0
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        max_tokens = s.check_lengths(len(token_ids), max_tokens, param, "messages")
        params = s.sampling_params(req, max_tokens=max_tokens, n=req.n, stop=req.stop, logprobs=logprobs,
                                   structured_outputs=constraint)
        request_id = random_id("chatcmpl-")
        if req.stream:
            outputs = await s.start(token_ids, params, request_id, lora_request=s.lora_request(model),
                                    mm_features=mm_features, grammar_param=grammar_param)
            return StreamingResponse(self._stream(req, model, request_id, token_ids, params, outputs, tools,
                                                  grammar_param), media_type="text/event-stream")
        [out] = await s.run_to_end(http, [(token_ids, params)], request_id, grammar_param, s.lora_request(model),
                                   mm_features)
        choices = []
        for c in out.outputs:
            parser = s.output_parser(tools, token_ids)
            parsed = parser.parse(c.text)
            calls = [ToolCallObject(t.id, FunctionCall(t.name, t.arguments)) for t in parsed.tool_calls]
            message = AssistantMessage(parsed.content, tool_calls=calls, reasoning_content=parsed.reasoning)
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=parser.finish_reason(
                c.finish_reason), logprobs=self._logprobs(c, params), stop_reason=c.stop_reason))
        num_completion = sum(len(c.token_ids) for c in out.outputs)
        usage = UsageInfo(len(token_ids), num_completion, len(token_ids) + num_completion,
                          PromptTokensDetails(out.num_cached_tokens))
        return Response(encode(ChatCompletionResponse(request_id, now(), model, choices, usage,
                                                      kv_transfer_params=out.kv_transfer_params)),
                        media_type="application/json")

    async def _stream(self, req: ChatCompletionRequest, model: str, request_id: str, token_ids: list[int],
                      params: SamplingParams, outputs, tools: ToolRequest | None,
                      grammar_param: str | None) -> AsyncIterator[bytes]:
        created = now()

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
            return sse(encode(ChatCompletionChunk(request_id, created, model, choices, usage)))

        # OpenAI opens each choice with the role and empty content.
        yield chunk([ChatChunkChoice(i, DeltaMessage(role="assistant", content="")) for i in range(req.n)])
        num_completion = 0
        held: dict[int, list] = {}  # per choice: logprobs of tokens whose text is held back, sent with that text
        parsers = {i: self.serving.output_parser(tools, token_ids) for i in range(req.n)}
        try:
            async for out in outputs:
                choices = []
                for c in out.outputs:
                    num_completion += len(c.token_ids)
                    if params.logprobs is not None and c.logprobs is not None:
                        held.setdefault(c.index, []).extend(shown_logprobs(c, params, self.serving.tokenizer))
                    parser = parsers[c.index]
                    delta = parser.feed(c.text, final=c.finish_reason is not None)
                    if not delta and c.finish_reason is None:
                        continue  # text held back (a stop string or a marker may be starting)
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = ChoiceLogprobs(token_logprobs(held.pop(c.index, []), params.logprobs))
                    choices.append(ChatChunkChoice(c.index, _delta_message(delta),
                                                   parser.finish_reason(c.finish_reason), logprobs))
                if choices:
                    yield chunk(choices)
                if out.finished and req.stream_options is not None and req.stream_options.include_usage:
                    usage = UsageInfo(len(token_ids), num_completion, len(token_ids) + num_completion,
                                      PromptTokensDetails(out.num_cached_tokens))
                    yield chunk([], usage)
        except Exception as e:
            yield sse(encode(engine_error(e, grammar_param).to_response()))
        finally:
            await outputs.aclose()  # a client gone mid-stream: abort
        yield b"data: [DONE]\n\n"

    def _logprobs(self, c: CompletionOutput, params: SamplingParams) -> ChoiceLogprobs | None:
        """The tokens of the text returned (a hidden stop token left out), each with its top params.logprobs."""
        if params.logprobs is None or c.logprobs is None:
            return None
        return ChoiceLogprobs(token_logprobs(shown_logprobs(c, params, self.serving.tokenizer), params.logprobs))


def _delta_message(delta: ChoiceDelta) -> DeltaMessage:
    calls = [DeltaToolCall(d.index, DeltaFunction(d.name, d.arguments if d.name is None else ""), d.id,
                           "function" if d.id else None) for d in delta.tool_calls]
    return DeltaMessage(content=delta.content or None, reasoning_content=delta.reasoning or None,
                        tool_calls=calls or None)
