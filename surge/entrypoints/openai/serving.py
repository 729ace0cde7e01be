"""What every OpenAI endpoint shares: the model name check, conversation rendering, context-length checks,
sampling parameters from request fields, and running requests (until done, or until the client disconnects).
"""
from __future__ import annotations

import asyncio
import functools
import re
import time
import uuid
from collections.abc import AsyncIterator

import jinja2
import jinja2.meta
import msgspec
from starlette.requests import Request as HTTPRequest

from surge.engine.async_llm import AsyncLLM, RequestFailedError
from surge.engine.core_proc import EngineDeadError
from surge.engine.detokenizer import special_token_ids
from surge.engine.output_processor import OutputKind
from surge.entrypoints.openai.choice_output import ChoiceOutputParser
from surge.entrypoints.openai.content import ImagePart, content_text, load_images
from surge.entrypoints.openai.errors import APIError, bad_request, internal_error
from surge.entrypoints.openai.limits import INT64_MAX, INT64_MIN, check_int_range
from surge.entrypoints.openai.options import ServerOptions
from surge.entrypoints.openai.protocol import ChatMessage, SamplingFields, TokenLogprob, TopLogprob
from surge.entrypoints.openai.tools import ToolRequest, template_tool_calls
from surge.lora_request import LoRARequest
from surge.multimodal import MultiModalFeature
from surge.outputs import CompletionOutput, Logprob, RequestOutput
from surge.pooling_params import PoolingParams
from surge.sampling_params import SamplingParams, StructuredOutputsParams
from surge.structured_output.reasoning import REASONING_MARKERS
from surge.structured_output.reasoning_gate import prompt_opens_reasoning

MAX_TEMPERATURE = 2.0  # OpenAI's range
ROLES = ("system", "developer", "user", "assistant", "tool")
# Arguments of the renderer itself (HF's apply_chat_template) and the variables it sets: never a request's kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
    "tools", "documents", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding",
    "truncation", "max_length", "return_tensors", "processor_kwargs", "bos_token", "eos_token",
    "raise_exception", "strftime_now"})
_SAMPLING_PARAM = re.compile(r"^SamplingParams\.(\w+)=")


def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def sse(data: bytes, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"


def engine_error(e: Exception, grammar_param: str | None = None) -> APIError:
    """An engine-side failure as the HTTP error to answer with. grammar_param: where the request's output grammar
    came from, named by a refusal that does not name its parameter (a schema the grammar library rejects)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, RequestFailedError) and e.invalid_request or isinstance(e, ValueError):
        return bad_request(str(e), param=grammar_param)
    return internal_error(e, "the engine")


class ClientDisconnected(Exception):
    pass


class RequestStream:
    """A started request's outputs. Closing it, or cancelling a wait on it, before the end aborts the request (its
    KV blocks are freed), whether or not it was ever iterated."""

    def __init__(self, engine: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.engine, self.request_id, self.queue = engine, request_id, queue
        self.finished = False
        self.first: RequestOutput | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def wait_first(self) -> None:
        """Waits for the first output, so that a refusal the engine core sends back (a grammar it cannot compile)
        raises here, before a response starts."""
        self.first = await self.__anext__()

    async def __anext__(self) -> RequestOutput:
        if self.first is not None:
            item, self.first = self.first, None
            return item
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finished:
            await self.aclose()
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            await self.engine.abort(self.request_id)  # frees an unfinished request; forgets a finished one


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], options: ServerOptions | None = None) -> None:
        self.engine = engine
        self.options = options or ServerOptions()
        self.limits = self.options.limits
        self.model_names = served_model_names
        self.max_model_len = engine.config.scheduler_config.max_model_len
        self.tokenizer = engine.tokenizer
        self.loras: dict[str, LoRARequest] = {}  # LoRA adapters served by name (a request's `model`)

    # ---- checks ----
    def check_model(self, model: str | None) -> str:
        """The name to answer with; a request without a model gets the first served name."""
        if self.engine.dead_error is not None:
            raise engine_error(self.engine.dead_error)
        if model is None or model in self.model_names or model in self.loras:
            return model or self.model_names[0]
        served = [*self.model_names, *self.loras]
        raise APIError(404, f"the model {model!r} does not exist; served: {', '.join(served)}",
                       param="model", code="model_not_found")

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a checked model name stands for (None: the base model)."""
        return self.loras.get(model)

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
        if max_tokens < (0 if allow_zero else 1):
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
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        limits = self.limits
        limits.check_n(n)
        limits.check_stop(stop)
        # 64-bit integers in the engine: each child of n draws seed + i
        check_int_range(req.seed, "seed", INT64_MIN, INT64_MAX - (n - 1))
        check_int_range(req.top_k, "top_k", -1, INT64_MAX)
        check_int_range(req.min_tokens, "min_tokens", 0, INT64_MAX)
        if req.stop_token_ids is not None:
            if len(req.stop_token_ids) > limits.max_stop_token_ids:
                raise bad_request(f"stop_token_ids has {len(req.stop_token_ids)} ids; at most "
                                  f"{limits.max_stop_token_ids} are allowed (--max-stop-token-ids)",
                                  param="stop_token_ids")
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None:
                limits.check_logprobs(value, name)
        if req.kv_transfer_params is not None:  # opaque to the server, but it crosses to the engine as msgpack
            try:
                msgspec.msgpack.encode(req.kv_transfer_params)
            except (OverflowError, TypeError) as e:
                raise bad_request(f"kv_transfer_params is invalid: {e} (integers must fit in 64 bits)",
                                  param="kv_transfer_params") from None
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
                structured_outputs=structured_outputs,
                kv_transfer_params=req.kv_transfer_params,
                **{k: v for k, v in fields.items() if v is not None})
        except ValueError as e:
            message = str(e)
            param = _SAMPLING_PARAM.match(message)
            raise bad_request(message.removeprefix("SamplingParams."),
                              param=param.group(1) if param else None) from None

    def output_parser(self, tools: ToolRequest | None, prompt_token_ids: list[int]) -> ChoiceOutputParser:
        """A new parser of one choice's output (reasoning, tool calls) for a request with this prompt."""
        name = self.options.reasoning_parser
        markers = REASONING_MARKERS[name] if name is not None else None
        opened = markers is not None and markers.prompt_decides and prompt_opens_reasoning(
            markers, self.tokenizer, prompt_token_ids)
        return ChoiceOutputParser(name, tools, self.options.tool_call_parser, opened)

    # ---- prompts ----
    def image_parts(self) -> list[ImagePart] | None:
        """The list a conversation's image parts go to: a multimodal model's (empty); None when the model takes no
        images (an image part is then a 400 that says so)."""
        return [] if self.engine.input_processor.image_placeholder() is not None else None

    def chat_messages(self, messages: list[ChatMessage], param: str = "messages",
                      images: list[ImagePart] | None = None) -> list[dict]:
        """Chat-shaped messages as the chat template takes them: {"role", "content": text, tool calls}. images: a
        multimodal model's list, which takes the image parts in order (each part's text: the model's image
        placeholder); None: image parts are a 400."""
        out = []
        placeholder = self.engine.input_processor.image_placeholder() if images is not None else ""
        for i, m in enumerate(messages):
            where = f"{param}[{i}]"
            message = self.message(m.role, m.content, where, images, placeholder)
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls is not None:
                message["tool_calls"] = template_tool_calls(m.tool_calls, f"{where}.tool_calls")
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out

    @staticmethod
    def message(role: str, content, param: str, images: list | None = None, placeholder: str = "") -> dict:
        if role not in ROLES:
            raise bad_request(f"{param}.role={role!r} is invalid; allowed: {', '.join(ROLES)}", param=f"{param}.role")
        # Chat templates know "system"; OpenAI's newer "developer" role means the same to an open model.
        return {"role": "system" if role == "developer" else role,
                "content": content_text(content, f"{param}.content", images, placeholder)}

    def render(self, conversation: list[dict], add_generation_prompt: bool = True,
               template_kwargs: dict | None = None, chat_template: str | None = None,
               tools: list[dict] | None = None, as_text: bool = False) -> list[int] | str:
        """The conversation's token ids (as_text: the template's text)."""
        if not conversation:
            raise bad_request("the conversation is empty: give at least one message", param="messages")
        if chat_template is not None and not self.options.trust_request_chat_template:
            raise bad_request("chat_template: this server runs only its model's chat template; start it with "
                              "--trust-request-chat-template to accept templates from requests",
                              param="chat_template")
        kwargs = self._template_kwargs(template_kwargs, chat_template)
        if tools is not None:
            kwargs["tools"] = tools
        try:
            render = self.engine.input_processor.render_chat_text if as_text else self.engine.input_processor.render_chat
            return render(conversation, add_generation_prompt, chat_template, **kwargs)
        except jinja2.TemplateError as e:  # e.g. a template that insists on alternating roles
            raise bad_request(f"the chat template refused this conversation: {e}") from None
        except Exception as e:  # a template is a program: whatever it raises on this request is the request's
            raise bad_request(f"the chat template failed on this conversation: {type(e).__name__}: "
                              f"{str(e)[:300]}") from None

    async def render_images(self, conversation: list[dict], images: list[ImagePart],
                            add_generation_prompt: bool = True, template_kwargs: dict | None = None, chat_template: str | None = None,
                            tools: list[dict] | None = None, param: str = "messages"
                            ) -> tuple[list[int], list[MultiModalFeature]]:
        """render() for a conversation with images: the template's text through the model's processor. Loading the
        images (decoding, a file, a fetch) and the processor take long for large ones, so a worker thread runs them
        and the event loop goes on serving meanwhile."""
        if not images:
            return self.render(conversation, add_generation_prompt, template_kwargs, chat_template, tools), []
        try:
            self.engine.input_processor.check_image_count(len(images))  # before any image is fetched
        except ValueError as e:
            raise bad_request(str(e), param=param, code="too_many_images") from None
        text = self.render(conversation, add_generation_prompt, template_kwargs, chat_template, tools, as_text=True)
        return await asyncio.to_thread(self._process_images, text, images, param)

    def _process_images(self, text: str, parts: list[ImagePart], param: str
                        ) -> tuple[list[int], list[MultiModalFeature]]:
        processor = self.engine.input_processor
        images = load_images(parts, processor.media)
        try:
            return processor.process_images(text, {"image": images}, add_special_tokens=False)
        except ValueError as e:
            raise bad_request(str(e), param=param) from None
        except Exception as e:  # the HF processor on a decodable but odd image (a 1-pixel-wide strip, ...)
            raise bad_request(f"the model's image processor failed on this request: {type(e).__name__}: "
                              f"{str(e)[:300]}", param=param) from None

    def _template_kwargs(self, kwargs: dict | None, chat_template: str | None) -> dict:
        """chat_template_kwargs without the renderer's own arguments, and only those the template reads."""
        if not kwargs:
            return {}
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them",
                              param="chat_template_kwargs")
        read = self.engine.input_processor.template_variables(chat_template)
        if read is None:
            template = chat_template if chat_template is not None else self.tokenizer.chat_template
            read = _template_variables(template) if isinstance(template, str) else frozenset()
        return {k: v for k, v in kwargs.items() if k in read}

    def check_token_ids(self, token_ids: list, param: str) -> list[int]:
        """Token ids of this model's vocabulary (a 400 naming param otherwise)."""
        vocab = self.engine.config.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise bad_request(f"{param} must be token ids in [0, {vocab})", param=param)
        return token_ids

    # ---- running ----
    async def start(self, token_ids: list[int], params: SamplingParams, request_id: str,
                    prompt_text: str | None = None, lora_request: LoRARequest | None = None,
                    mm_features: list[MultiModalFeature] | None = None,
                    grammar_param: str | None = None) -> RequestStream:
        """Adds the request now, so that one the engine refuses is an HTTP error (engine_error's, grammar_param as
        there) before a stream begins; then its outputs as they come. A request with a grammar waits for its first
        output: the core compiles the grammar and may refuse it."""
        prompt = {"prompt_token_ids": token_ids, "prompt": prompt_text, "mm_features": mm_features or []}
        try:
            try:
                queue = await self.engine.add_request(request_id, prompt, params, OutputKind.DELTA,
                                                      lora_request=lora_request)
            except ValueError as e:
                raise bad_request(str(e), param="model" if lora_request is not None else None) from None
            stream = RequestStream(self.engine, request_id, queue)
            if params.structured_outputs is not None:
                await stream.wait_first()
        except Exception as e:
            raise engine_error(e, grammar_param) from None
        return stream

    async def run_to_end(self, http: HTTPRequest, prompts: list[tuple[list[int], SamplingParams | PoolingParams]],
                         request_id: str, grammar_param: str | None = None,
                         lora_request: LoRARequest | None = None,
                         mm_features: list[MultiModalFeature] | None = None) -> list[RequestOutput]:
        """Final outputs of one request per (prompt, params); all are aborted when the client disconnects. Pooling
        params make pooling requests (PoolingRequestOutputs). mm_features: the images of every prompt."""
        async def one(i: int, token_ids: list[int], params: SamplingParams | PoolingParams) -> RequestOutput:
            final = None
            pooling = params if isinstance(params, PoolingParams) else None
            prompt = {"prompt_token_ids": token_ids, "mm_features": mm_features or []}
            async for out in self.engine.generate(prompt, params, f"{request_id}-p{i}",
                                                  OutputKind.FINAL_ONLY, pooling, lora_request):
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
        raise engine_error(error, grammar_param)


@functools.lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads (those it does not set itself)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateError:
        return frozenset()


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
