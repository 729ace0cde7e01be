"""Request and response bodies of the OpenAI-compatible API as msgspec Structs.

Requests are decoded with `decode_request` (malformed JSON and wrong types become 400s naming the parameter);
unknown fields are ignored, as OpenAI clients send fields Surge does not use. Field names follow OpenAI's, and
vLLM's extra sampling fields (top_k, min_p, ...) are accepted too.
"""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from surge.entrypoints.openai.errors import bad_request, from_validation_error

T = TypeVar("T")


def decode_request(body: bytes, type: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as e:
        raise from_validation_error(e) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None


# ---- requests ----
class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Sampling fields every generation API shares (vLLM's extras included)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Prefill/decode disaggregation (as vLLM): {"do_remote_decode": true} on the prefill leg; the params the prefill
    # instance returned on the decode leg.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    model: str | None = None
    prompt: str | list[Any]  # a string, token ids, or a list of either (checked in completions.py)
    max_tokens: int | None = 16
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None
    echo: bool = False
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar or json_object
    best_of: int | None = None
    suffix: str | None = None
    user: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    reasoning_content: str | None = None  # an assistant's earlier reasoning, sent back: not rendered


class ChatCompletionRequest(SamplingFields, kw_only=True):
    model: str | None = None
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # none | auto | required | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = True
    response_format: Any = None
    structured_outputs: dict[str, Any] | None = None
    user: str | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None


class ResponsesRequest(SamplingFields, kw_only=True):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    store: bool = True  # accepted and ignored: Surge's Responses API is stateless
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # none | auto | required | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = True
    text: Any = None
    structured_outputs: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None  # "message.output_text.logprobs": logprobs of the output text
    top_logprobs: int | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# ---- responses: shared ----
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(msgspec.Struct):
    """OpenAI's model object, with vLLM's additions (max_model_len, root, parent)."""
    id: str
    created: int
    max_model_len: int
    root: str
    object: str = "model"
    owned_by: str = "surge"
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


# ---- completions ----
class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's, for the decode leg


# ---- chat completions ----
class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallObject(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallObject] = []
    reasoning_content: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's, for the decode leg


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A call's first delta carries its id, type and name (arguments ""); the next ones argument text only."""
    index: int
    function: DeltaFunction
    id: str | None = None
    type: str | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"


# ---- responses API ----
class OutputText(msgspec.Struct):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []
    type: str = "output_text"


class FunctionCallItem(msgspec.Struct):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    type: str = "function_call"


class ReasoningText(msgspec.Struct):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = []
    status: str = "completed"
    type: str = "reasoning"


class OutputMessage(msgspec.Struct):
    id: str
    status: str  # in_progress | completed | incomplete
    content: list[OutputText]
    role: str = "assistant"
    type: str = "message"


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(msgspec.Struct):
    reason: str  # max_output_tokens


class ResponseObject(msgspec.Struct):
    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete | failed
    output: list[Any]  # OutputMessage, FunctionCallItem, ReasoningItem
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str] | None
    parallel_tool_calls: bool
    tool_choice: Any
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: Any = None
    tools: list[Any] = []
    previous_response_id: str | None = None
    store: bool = False
    truncation: str = "disabled"
    text: Any = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    object: str = "response"
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's, for the decode leg


class ResponseEvent(msgspec.Struct, omit_defaults=True):
    """One server-sent event of a streamed response; which fields it carries depends on `type`."""
    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: Any = None  # an output item
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None  # response.function_call_arguments.done
    logprobs: list[Any] | None = None
    # type "error"
    code: str | None = None
    message: str | None = None
    param: str | None = None


# ---- tokenize ----
class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct):
    prompt: str
