"""POST /v1/chat/completions: a conversation rendered by the model's chat template, n samples, streamed or not."""
from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from surge.entrypoints.openai.errors import bad_request
from surge.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                               ChatCompletionRequest, ChatCompletionResponse, ChoiceLogprobs,
                                               DeltaMessage, PromptTokensDetails, UsageInfo)
from surge.entrypoints.openai.serving import (MAX_TOP_LOGPROBS, OpenAIServing, encode, engine_error, now, random_id,
                                              shown_logprobs, sse, token_logprobs)
from surge.outputs import CompletionOutput
from surge.sampling_params import SamplingParams


class ChatHandler:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def render(self, req: ChatCompletionRequest) -> list[int]:
        s = self.serving
        return s.render(s.chat_messages(req.messages), req.add_generation_prompt, req.chat_template_kwargs)

    async def create(self, req: ChatCompletionRequest, http: HTTPRequest) -> Response:
        s = self.serving
        model = s.check_model(req.model)
        if req.tools:
            raise bad_request("tools are not supported yet", param="tools")
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise bad_request("response_format other than {'type': 'text'} is not supported yet",
                              param="response_format")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
        logprobs = None
        if req.logprobs:
            logprobs = req.top_logprobs or 0
            if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs={logprobs} is invalid: must be in [0, {MAX_TOP_LOGPROBS}]",
                                  param="top_logprobs")
        elif req.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        token_ids = self.render(req)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = s.check_lengths(len(token_ids), req.max_completion_tokens or req.max_tokens, param, "messages")
        params = s.sampling_params(req, max_tokens=max_tokens, n=req.n, stop=req.stop, logprobs=logprobs)
        request_id = random_id("chatcmpl-")
        if req.stream:
            return StreamingResponse(self._stream(req, model, request_id, token_ids, params),
                                     media_type="text/event-stream")
        [out] = await s.run_to_end(http, [(token_ids, params)], request_id)
        choices = [ChatChoice(index=c.index, message=AssistantMessage(c.text), finish_reason=c.finish_reason,
                              logprobs=self._logprobs(c, params), stop_reason=c.stop_reason) for c in out.outputs]
        num_completion = sum(len(c.token_ids) for c in out.outputs)
        usage = UsageInfo(len(token_ids), num_completion, len(token_ids) + num_completion,
                          PromptTokensDetails(out.num_cached_tokens))
        return Response(encode(ChatCompletionResponse(request_id, now(), model, choices, usage,
                                                      kv_transfer_params=out.kv_transfer_params)),
                        media_type="application/json")

    async def _stream(self, req: ChatCompletionRequest, model: str, request_id: str, token_ids: list[int],
                      params: SamplingParams) -> AsyncIterator[bytes]:
        created = now()

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
            return sse(encode(ChatCompletionChunk(request_id, created, model, choices, usage)))

        # OpenAI opens each choice with the role and empty content.
        yield chunk([ChatChunkChoice(i, DeltaMessage(role="assistant", content="")) for i in range(req.n)])
        num_completion = 0
        held: dict[int, list] = {}  # per choice: logprobs of tokens whose text is held back, sent with that text
        try:
            async for out in self.serving.stream(token_ids, params, request_id):
                choices = []
                for c in out.outputs:
                    num_completion += len(c.token_ids)
                    if params.logprobs is not None and c.logprobs is not None:
                        held.setdefault(c.index, []).extend(shown_logprobs(c, params, self.serving.tokenizer))
                    if not c.text and c.finish_reason is None:
                        continue  # text held back (a stop string may be starting) or an unfinished character
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = ChoiceLogprobs(token_logprobs(held.pop(c.index, []), params.logprobs))
                    choices.append(ChatChunkChoice(c.index, DeltaMessage(content=c.text or None), c.finish_reason,
                                                   logprobs))
                if choices:
                    yield chunk(choices)
                if out.finished and req.stream_options is not None and req.stream_options.include_usage:
                    usage = UsageInfo(len(token_ids), num_completion, len(token_ids) + num_completion,
                                      PromptTokensDetails(out.num_cached_tokens))
                    yield chunk([], usage)
        except Exception as e:
            yield sse(encode(engine_error(e).to_response()))
        yield b"data: [DONE]\n\n"

    def _logprobs(self, c: CompletionOutput, params: SamplingParams) -> ChoiceLogprobs | None:
        """The tokens of the text returned (a hidden stop token left out), each with its top params.logprobs."""
        if params.logprobs is None or c.logprobs is None:
            return None
        return ChoiceLogprobs(token_logprobs(shown_logprobs(c, params, self.serving.tokenizer), params.logprobs))
