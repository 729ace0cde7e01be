"""POST /v1/completions: one or more prompts (text or token ids), n samples each, streamed or not.

`echo` with `logprobs` also scores the prompt (its first token's logprob is null, as in OpenAI and vLLM), and
`max_tokens: 0` with `echo` scores it without generating: how lm-evaluation-harness gets log-likelihoods."""
from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from surge.engine.detokenizer import decode_token
from surge.entrypoints.openai import structured
from surge.entrypoints.openai.errors import bad_request
from surge.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                               CompletionResponse, PromptTokensDetails, UsageInfo)
from surge.entrypoints.openai.serving import (OpenAIServing, encode, engine_error, merge, now, random_id, sse,
                                              top_logprobs)
from surge.outputs import CompletionOutput, Logprob, RequestOutput
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
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens=0 is invalid without echo=true: it generates nothing, so only the echoed "
                              "prompt (with its logprobs) can be returned", param="max_tokens")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
        constraint, grammar_param = structured.one_constraint(
            response_format=structured.response_format(req.response_format),
            structured_outputs=structured.extra_structured_outputs(req.structured_outputs))
        prompts = self.prompts(req.prompt)
        prompt_logprobs = req.logprobs if req.echo else None
        requests = []
        for text, ids in prompts:
            max_tokens = s.check_lengths(len(ids), req.max_tokens, "max_tokens", "prompt", allow_zero=req.echo)
            requests.append((ids, s.sampling_params(req, max_tokens=max_tokens, n=req.n, stop=req.stop,
                                                    logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
                                                    structured_outputs=constraint)))
        request_id = random_id("cmpl-")
        if req.stream:
            streams = []
            try:
                for i, (ids, params) in enumerate(requests):
                    streams.append(await s.start(ids, params, f"{request_id}-p{i}", prompts[i][0],
                                                 s.lora_request(model), grammar_param=grammar_param))
            except Exception:
                for started in streams:
                    await started.aclose()  # aborts the prompts already added
                raise
            return StreamingResponse(self._stream(req, model, request_id, prompts, requests, streams, grammar_param),
                                     media_type="text/event-stream")
        outputs = await s.run_to_end(http, requests, request_id, grammar_param, s.lora_request(model))
        choices = []
        for p, out in enumerate(outputs):
            prefix = self._prompt_text(prompts[p]) if req.echo else ""
            for c in out.outputs:
                choices.append(CompletionChoice(index=p * req.n + c.index, text=prefix + c.text,
                                                logprobs=self._logprobs(c, requests[p][1], out if req.echo else None),
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        usage = UsageInfo(num_prompt, num_completion, num_prompt + num_completion,
                          PromptTokensDetails(sum(o.num_cached_tokens for o in outputs)))
        return Response(encode(CompletionResponse(request_id, now(), model, choices, usage,
                                                  kv_transfer_params=outputs[0].kv_transfer_params)),
                        media_type="application/json")

    def _prompt_text(self, prompt: tuple[str | None, list[int]]) -> str:
        text, ids = prompt
        return text if text is not None else self.serving.tokenizer.decode(ids)

    async def _stream(self, req: CompletionRequest, model: str, request_id: str,
                      prompts: list[tuple[str | None, list[int]]],
                      requests: list[tuple[list[int], SamplingParams]], streams: list[AsyncIterator],
                      grammar_param: str | None) -> AsyncIterator[bytes]:
        created = now()
        echoed: set[int] = set()
        num_completion = num_cached = 0
        try:
            async for p, out in merge(streams):
                for c in out.outputs:
                    index = p * req.n + c.index
                    num_completion += len(c.token_ids)
                    text, echo = c.text, None
                    if req.echo and index not in echoed:  # a choice's first chunk starts with the prompt
                        echoed.add(index)
                        text, echo = self._prompt_text(prompts[p]) + text, out
                    if not text and c.finish_reason is None:
                        continue
                    choice = CompletionChoice(index, text, self._logprobs(c, requests[p][1], echo), c.finish_reason,
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
            yield sse(encode(engine_error(e, grammar_param).to_response()))
        finally:
            for stream in streams:
                await stream.aclose()  # a client gone mid-stream: abort
        yield b"data: [DONE]\n\n"

    def _logprobs(self, c: CompletionOutput, params: SamplingParams,
                  echo: RequestOutput | None = None) -> CompletionLogprobs | None:
        """The legacy logprobs object: the echoed prompt's tokens first when `echo` is given (the first one
        unscored), then the generated ones; text offsets count from the start of the choice's text."""
        num = params.logprobs
        if num is None or c.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = 0

        def add(token: str, logprob: float | None, top_n: dict[str, float] | None) -> None:
            nonlocal offset
            tokens.append(token)
            token_logprobs.append(logprob)
            top.append(top_n)
            offsets.append(offset)
            offset += len(token)

        if echo is not None:
            tokenizer = self.serving.tokenizer
            for token_id, position in zip(echo.prompt_token_ids, echo.prompt_logprobs or []):
                if position is None:  # the first prompt token: nothing before it to score it by
                    add(decode_token(tokenizer, token_id), None, None)
                else:
                    add(position[token_id].decoded_token or "", position[token_id].logprob, _top(position, num))
        # Every generated token, a final stop token included (as vLLM): scorers count on one entry per token.
        for token_id, position in zip(c.token_ids, c.logprobs):
            sampled: Logprob = position[token_id]
            add(sampled.decoded_token or "", sampled.logprob, _top(position, num))
        return CompletionLogprobs(tokens, token_logprobs, top, offsets)


def _top(position: dict[int, Logprob], num: int) -> dict[str, float]:
    return {lp.decoded_token or "": lp.logprob for lp in top_logprobs(position, num)}
