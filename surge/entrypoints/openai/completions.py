"""POST /v1/completions: one or more prompts (text or token ids), n samples each, streamed or not."""
from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from surge.entrypoints.openai.errors import bad_request
from surge.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                               CompletionResponse, PromptTokensDetails, UsageInfo)
from surge.entrypoints.openai.serving import (OpenAIServing, encode, engine_error, merge, now, random_id, sse,
                                              top_logprobs)
from surge.outputs import CompletionOutput, Logprob
from surge.sampling_params import SamplingParams


class CompletionsHandler:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) per prompt: a string, a list of token ids, or a list of either."""
        s = self.serving
        if isinstance(prompt, str):
            return [(prompt, s.tokenizer.encode(prompt))]
        if not prompt:
            raise bad_request("prompt is empty", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [(None, s.check_token_ids(prompt, "prompt"))]
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                out.append((p, s.tokenizer.encode(p)))
            elif isinstance(p, list):
                out.append((None, s.check_token_ids(p, f"prompt[{i}]")))
            else:
                raise bad_request("prompt must be a string, a list of token ids, or a list of strings or of token "
                                  "id lists", param="prompt")
        return out

    async def create(self, req: CompletionRequest, http: HTTPRequest) -> Response:
        s = self.serving
        model = s.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported yet", param="echo")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
        prompts = self.prompts(req.prompt)
        requests = []
        for text, ids in prompts:
            max_tokens = s.check_lengths(len(ids), req.max_tokens, "max_tokens", "prompt")
            requests.append((ids, s.sampling_params(req, max_tokens=max_tokens, n=req.n, stop=req.stop,
                                                    logprobs=req.logprobs)))
        request_id = random_id("cmpl-")
        if req.stream:
            return StreamingResponse(self._stream(req, model, request_id, prompts, requests),
                                     media_type="text/event-stream")
        outputs = await s.run_to_end(http, requests, request_id)
        choices = []
        for p, out in enumerate(outputs):
            prefix = self._prompt_text(prompts[p]) if req.echo else ""
            for c in out.outputs:
                choices.append(CompletionChoice(index=p * req.n + c.index, text=prefix + c.text,
                                                logprobs=self._logprobs(c, req.logprobs),
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        usage = UsageInfo(num_prompt, num_completion, num_prompt + num_completion,
                          PromptTokensDetails(sum(o.num_cached_tokens for o in outputs)))
        return Response(encode(CompletionResponse(request_id, now(), model, choices, usage)),
                        media_type="application/json")

    def _prompt_text(self, prompt: tuple[str | None, list[int]]) -> str:
        text, ids = prompt
        return text if text is not None else self.serving.tokenizer.decode(ids)

    async def _stream(self, req: CompletionRequest, model: str, request_id: str,
                      prompts: list[tuple[str | None, list[int]]],
                      requests: list[tuple[list[int], SamplingParams]]) -> AsyncIterator[bytes]:
        s = self.serving
        created = now()
        streams = [s.stream(ids, params, f"{request_id}-p{i}", prompts[i][0])
                   for i, (ids, params) in enumerate(requests)]
        echoed: set[int] = set()
        num_completion = num_cached = 0
        try:
            async for p, out in merge(streams):
                for c in out.outputs:
                    index = p * req.n + c.index
                    num_completion += len(c.token_ids)
                    text = c.text
                    if req.echo and index not in echoed:
                        echoed.add(index)
                        text = self._prompt_text(prompts[p]) + text
                    if not text and c.finish_reason is None:
                        continue
                    choice = CompletionChoice(index, text, self._logprobs(c, req.logprobs), c.finish_reason,
                                              c.stop_reason)
                    yield sse(encode(CompletionResponse(request_id, created, model, [choice])))
                if out.finished:
                    num_cached += out.num_cached_tokens
            if req.stream_options is not None and req.stream_options.include_usage:
                num_prompt = sum(len(ids) for _, ids in prompts)
                usage = UsageInfo(num_prompt, num_completion, num_prompt + num_completion,
                                  PromptTokensDetails(num_cached))
                yield sse(encode(CompletionResponse(request_id, created, model, [], usage)))
        except Exception as e:
            yield sse(encode(engine_error(e).to_response()))
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _logprobs(c: CompletionOutput, num: int | None) -> CompletionLogprobs | None:
        if num is None or c.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = 0
        for token_id, position in zip(c.token_ids, c.logprobs):
            sampled: Logprob = position[token_id]
            token = sampled.decoded_token or ""
            tokens.append(token)
            token_logprobs.append(sampled.logprob)
            top.append({lp.decoded_token or "": lp.logprob for lp in top_logprobs(position, num)})
            offsets.append(offset)
            offset += len(token)
        return CompletionLogprobs(tokens, token_logprobs, top, offsets)

