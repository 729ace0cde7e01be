"""What every OpenAI endpoint shares: the model name check, conversation rendering, context-length checks,
sampling parameters from request fields, and running requests (until done, or until the client disconnects).
"""
from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator

import jinja2
import msgspec
from starlette.requests import Request as HTTPRequest

from surge.engine.async_llm import AsyncLLM, RequestFailedError
from surge.engine.core_proc import EngineDeadError
from surge.engine.detokenizer import special_token_ids
from surge.engine.output_processor import OutputKind
from surge.entrypoints.openai.content import content_text
from surge.entrypoints.openai.errors import APIError, bad_request
from surge.entrypoints.openai.protocol import ChatMessage, SamplingFields, TokenLogprob, TopLogprob
from surge.outputs import CompletionOutput, Logprob, RequestOutput
from surge.sampling_params import SamplingParams

MAX_N = 128  # samples per request; more would be a denial of service more than a use case
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_TOP_LOGPROBS = 20  # OpenAI's range for chat's and the Responses API's top_logprobs
ROLES = ("system", "developer", "user", "assistant", "tool")
_SAMPLING_PARAM = re.compile(r"^SamplingParams\.(\w+)=")


def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def sse(data: bytes, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"


def engine_error(e: Exception) -> APIError:
    """An engine-side failure as the HTTP error to answer with."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, RequestFailedError):
        return APIError(400 if e.invalid_request else 500, str(e))
    if isinstance(e, ValueError):
        return bad_request(str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


class ClientDisconnected(Exception):
    pass


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        self.engine = engine
        self.model_names = served_model_names
        self.max_model_len = engine.config.scheduler_config.max_model_len
        self.tokenizer = engine.tokenizer

    # ---- checks ----
    def check_model(self, model: str | None) -> str:
        """The name to answer with; a request without a model gets the first served name."""
        if self.engine.dead_error is not None:
            raise engine_error(self.engine.dead_error)
        if model is None or model in self.model_names:
            return model or self.model_names[0]
        raise APIError(404, f"the model {model!r} does not exist; served: {', '.join(self.model_names)}",
                       param="model", code="model_not_found")

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int | None, max_tokens_param: str,
                      prompt_param: str, allow_zero: bool = False) -> int:
        """The number of tokens to generate: max_tokens, or all the room left when None; 400 when it cannot fit.
        allow_zero: 0 means the prompt only (completions with echo: scoring a text)."""
        if num_prompt_tokens == 0:
            raise bad_request("the prompt is empty: at least one token is needed", param=prompt_param)
        room = self.max_model_len - num_prompt_tokens
        if room <= 0:
            raise bad_request(f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                              f"has {num_prompt_tokens} tokens, which leaves no room to generate",
                              param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            return room
        if isinstance(max_tokens, bool) or max_tokens < (0 if allow_zero else 1):
            raise bad_request(f"{max_tokens_param}={max_tokens} is invalid: must be an integer >= 1"
                              + (", or 0 for the prompt only" if allow_zero else ""), param=max_tokens_param)
        if max_tokens > room:
            raise bad_request(f"{max_tokens_param}={max_tokens} is too large: this model's maximum context length "
                              f"is {self.max_model_len} tokens and the prompt has {num_prompt_tokens}, so at most "
                              f"{room} tokens can be generated", param=max_tokens_param,
                              code="context_length_exceeded")
        return max_tokens

    def sampling_params(self, req: SamplingFields, *, max_tokens: int, n: int = 1,
                        stop: str | list[str] | None = None, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if not 1 <= n <= MAX_N:
            raise bad_request(f"n={n} is invalid: must be an integer in [1, {MAX_N}]", param="n")
        if req.temperature is not None and not 0.0 <= req.temperature <= MAX_TEMPERATURE:
            raise bad_request(f"temperature={req.temperature} is invalid: must be in [0, {MAX_TEMPERATURE}]",
                              param="temperature")
        fields = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                      presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                      repetition_penalty=req.repetition_penalty)
        try:
            return SamplingParams(
                n=n, max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed, stop=stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                kv_transfer_params=req.kv_transfer_params,
                **{k: v for k, v in fields.items() if v is not None})
        except ValueError as e:
            message = str(e)
            param = _SAMPLING_PARAM.match(message)
            raise bad_request(message.removeprefix("SamplingParams."),
                              param=param.group(1) if param else None) from None

    # ---- prompts ----
    def chat_messages(self, messages: list[ChatMessage], param: str = "messages") -> list[dict]:
        """Chat-shaped messages as the chat template takes them: {"role", "content": text}."""
        return [self.message(m.role, m.content, f"{param}[{i}]") for i, m in enumerate(messages)]

    @staticmethod
    def message(role: str, content, param: str) -> dict:
        if role not in ROLES:
            raise bad_request(f"{param}.role={role!r} is invalid; allowed: {', '.join(ROLES)}", param=f"{param}.role")
        # Chat templates know "system"; OpenAI's newer "developer" role means the same to an open model.
        return {"role": "system" if role == "developer" else role,
                "content": content_text(content, f"{param}.content")}

    def render(self, conversation: list[dict], add_generation_prompt: bool = True,
               template_kwargs: dict | None = None) -> list[int]:
        if not conversation:
            raise bad_request("the conversation is empty: give at least one message", param="messages")
        try:
            return self.engine.input_processor.render_chat(conversation, add_generation_prompt,
                                                           **(template_kwargs or {}))
        except jinja2.TemplateError as e:  # e.g. a template that insists on alternating roles
            raise bad_request(f"the chat template refused this conversation: {e}") from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    def check_token_ids(self, token_ids: list, param: str) -> list[int]:
        vocab = self.engine.config.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise bad_request(f"{param} must be token ids in [0, {vocab})", param=param)
        return token_ids

    # ---- running ----
    def stream(self, token_ids: list[int], params: SamplingParams, request_id: str,
               prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        prompt = {"prompt_token_ids": token_ids, "prompt": prompt_text}
        return self.engine.generate(prompt, params, request_id, OutputKind.DELTA)

    async def run_to_end(self, http: HTTPRequest, prompts: list[tuple[list[int], SamplingParams]],
                         request_id: str) -> list[RequestOutput]:
        """Final outputs of one request per (prompt, params); all are aborted when the client disconnects."""
        async def one(i: int, token_ids: list[int], params: SamplingParams) -> RequestOutput:
            final = None
            async for out in self.engine.generate({"prompt_token_ids": token_ids}, params, f"{request_id}-p{i}",
                                                  OutputKind.FINAL_ONLY):
                final = out
            return final

        async def all_of_them() -> list[RequestOutput]:
            async with asyncio.TaskGroup() as group:  # the first failure cancels (aborts) the others
                tasks = [group.create_task(one(i, ids, params)) for i, (ids, params) in enumerate(prompts)]
            return [t.result() for t in tasks]

        work = asyncio.ensure_future(all_of_them())
        disconnect = asyncio.ensure_future(_wait_for_disconnect(http))
        try:
            await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()  # each generate() aborts its request on cancellation, freeing its KV blocks
                await asyncio.gather(work, return_exceptions=True)
            disconnect.cancel()
        if work.cancelled():
            raise ClientDisconnected()
        error = work.exception()
        if error is None:
            return work.result()
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        raise engine_error(error)


async def _wait_for_disconnect(http: HTTPRequest) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(stream index, item) from several async iterators as items arrive; closing this closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as e:
            await queue.put((i, e))
        await queue.put((i, done))

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def top_logprobs(position: dict[int, Logprob], num: int) -> list[Logprob]:
    """The top-`num` entries of one position, best first (the sampled token only when it ranks among them)."""
    return sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= num), key=lambda lp: lp.rank)


def shown_logprobs(c: CompletionOutput, params: SamplingParams, tokenizer) -> list[tuple[int, dict[int, Logprob]]]:
    """(token id, logprobs) of the generated tokens whose text the output shows: a stop token it leaves out (EOS
    such as <|im_end|>, a special token the text skips) is left out here too. Works on deltas as on whole outputs:
    a stop token is always the last token."""
    pairs = list(zip(c.token_ids, c.logprobs or []))
    if (pairs and c.finish_reason == "stop" and not isinstance(c.stop_reason, str) and params.skip_special_tokens
            and pairs[-1][0] in special_token_ids(tokenizer)):
        pairs.pop()
    return pairs


def token_logprobs(pairs: list[tuple[int, dict[int, Logprob]]], num: int) -> list[TokenLogprob]:
    """Chat's and the Responses API's logprob objects: each token, its logprob and bytes, and the top `num`."""
    content = []
    for token_id, position in pairs:
        sampled = position[token_id]
        top = [TopLogprob(lp.decoded_token or "", lp.logprob, list((lp.decoded_token or "").encode()))
               for lp in top_logprobs(position, num)]
        token = sampled.decoded_token or ""
        content.append(TokenLogprob(token, sampled.logprob, list(token.encode()), top))
    return content


def now() -> int:
    return int(time.time())


def encode(obj) -> bytes:
    return msgspec.json.encode(obj)
