"""A request's output constraint as the engine's StructuredOutputsParams: Chat's and Completions's
`response_format`, the Responses API's `text.format`, vLLM's `structured_outputs`, and the forced tool calls."""
from __future__ import annotations

import json
import re
from typing import Any

from surge.entrypoints.openai.errors import bad_request
from surge.sampling_params import StructuredOutputsParams

_FORMATS = ("text", "json_object", "json_schema")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _schema(schema: Any, param: str) -> StructuredOutputsParams:
    if schema is None:  # a json_schema without its schema: any JSON object, as vLLM
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object)", param=param)
    return StructuredOutputsParams(json=schema if isinstance(schema, dict) else json.dumps(schema))


def _format_type(fmt: Any, param: str) -> str:
    if not isinstance(fmt, dict):
        raise bad_request(f"{param} must be an object such as {{'type': 'json_schema', ...}}", param=param)
    kind = fmt.get("type")
    if kind not in _FORMATS:
        raise bad_request(f"{param}.type={kind!r} is invalid: one of {', '.join(_FORMATS)}", param=f"{param}.type")
    return kind


def response_format(fmt: Any, param: str = "response_format") -> StructuredOutputsParams | None:
    """Chat's `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` and `{"type": "json_object"}`."""
    if fmt is None:
        return None
    kind = _format_type(fmt, param)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(f"{param}.json_schema must be an object with a 'schema'", param=f"{param}.json_schema")
    return _schema(spec.get("schema"), f"{param}.json_schema.schema")


def text_format(text: Any) -> StructuredOutputsParams | None:
    """The Responses API's `text: {"format": {"type": "json_schema", "name", "schema", "strict"}}`."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text must be an object such as {'format': {'type': 'text'}}", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = _format_type(fmt, "text.format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    # Unlike Chat's json_schema.schema, both are required here (OpenAI answers 400 without either).
    name = fmt.get("name")
    if name is None:
        raise bad_request("text.format.name is required when text.format.type is 'json_schema'",
                          param="text.format.name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise bad_request(f"text.format.name={name!r} is invalid: 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
                          param="text.format.name")
    if fmt.get("schema") is None:
        raise bad_request("text.format.schema is required when text.format.type is 'json_schema'",
                          param="text.format.schema")
    return _schema(fmt["schema"], "text.format.schema")


def extra_structured_outputs(value: Any) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object such as {'regex': '...'}", param="structured_outputs")
    allowed = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise bad_request(f"structured_outputs: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}",
                          param="structured_outputs")
    for flag in ("json_object", "disable_any_whitespace"):
        if not isinstance(value.get(flag, False), bool):
            raise bad_request(f"structured_outputs.{flag} must be a boolean", param=f"structured_outputs.{flag}")
    try:
        return StructuredOutputsParams(**value)
    except ValueError as e:
        raise bad_request(str(e).removeprefix("SamplingParams."), param="structured_outputs") from None


def one_constraint(**constraints: StructuredOutputsParams | None) -> tuple[StructuredOutputsParams | None, str | None]:
    """The one constraint given (and the parameter it came from); two at once is a 400 naming both."""
    given = {name: c for name, c in constraints.items() if c is not None}
    if len(given) > 1:
        names = ", ".join(given)
        raise bad_request(f"these ask for different output grammars at once: {names}; give one",
                          param=next(iter(given)))
    return next(iter(given.values()), None), next(iter(given), None)
