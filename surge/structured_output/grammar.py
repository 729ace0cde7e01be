"""A request's StructuredOutputsParams as an llguidance grammar (its JSON form); the manager starts a matcher from it
before the request is scheduled, and a schema, regex or grammar llguidance rejects is a ValueError naming the field.

llguidance compiles lazily (lexer states are built as the output reaches them), so checking and starting a new
schema costs little up front; its masks are computed in Rust without the GIL.
"""
from __future__ import annotations

import json

import llguidance

from surge.sampling_params import StructuredOutputsParams

# What json_object means: any JSON object (as vLLM and OpenAI's JSON mode).
_ANY_OBJECT = {"type": "object"}


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for one request's constraint; ValueError when it cannot be built."""
    kind = params.kind
    options = {"whitespace_flexible": not params.disable_any_whitespace}
    try:
        if kind in ("json", "json_object"):
            schema = _ANY_OBJECT if kind == "json_object" else params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"structured_outputs.{kind} is invalid: {e}") from None

