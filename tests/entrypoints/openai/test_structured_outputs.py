"""Structured output and forced tool calls through a live server on the default model (issue 13's acceptance):
what comes back is checked with `jsonschema` and pydantic, independent of the grammar library that shaped it.
50 prompts under one schema (nested objects, arrays, enums, required fields), streamed and not; the official
client's `chat.completions.parse`; tool_choice "required" and a named function, on Chat and on Responses."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from remote_server import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "color", "address", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


class Address(BaseModel):
    city: str = Field(max_length=10)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=10)
    color: Literal["red", "green", "blue"]
    address: Address
    tags: list[Literal["a", "b", "c"]] = Field(min_length=1, max_length=2)


@pytest.fixture(scope="module")
def server():
    with RemoteServer(None, "--max-model-len", "1024", "--kv-cache-memory", str(256 << 20)) as s:
        yield s


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe person number {i} as JSON: name, favourite colour, address and "
                                         f"tags."}] for i in range(n)]


def test_50_prompts_valid_under_the_schema_streamed_and_not(server):
    async def one(client, messages, stream: bool) -> tuple[str, str]:
        common = dict(model=MODEL, messages=messages, max_tokens=100, temperature=0, response_format=RESPONSE_FORMAT)
        if not stream:
            out = await client.chat.completions.create(**common)
            return out.choices[0].message.content, out.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await client.chat.completions.create(stream=True, **common):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        client = server.async_client().with_options(timeout=900)
        try:
            return await asyncio.gather(*[one(client, m, stream) for stream in (False, True) for m in prompts(50)])
        finally:
            await client.close()

    results = asyncio.run(asyncio.wait_for(main(), 900))
    assert len(results) == 100
    for text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert [t for t, _ in results[:50]] == [t for t, _ in results[50:]]  # greedy: streamed equals unstreamed


def test_json_object_and_completions_structured_outputs(server):
    client = server.client().with_options(timeout=600)
    out = client.chat.completions.create(model=MODEL, messages=prompts(1)[0], max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=5, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert out.choices[0].text in ("red", "green", "blue")
    out = client.completions.create(model=MODEL, prompt="A zip code:", max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{5}"}})
    assert len(out.choices[0].text) == 5 and out.choices[0].text.isdigit()


def test_parse_with_a_pydantic_model(server):
    client = server.client().with_options(timeout=600)
    completion = client.chat.completions.parse(model=MODEL, messages=prompts(1)[0], max_tokens=160, temperature=0,
                                               response_format=Person)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)
    response = client.responses.parse(model=MODEL, input=prompts(1)[0], max_output_tokens=160, temperature=0,
                                      text_format=Person)
    assert isinstance(response.output_parsed, Person)


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}},
                                    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_library_rejects_is_400(server, schema, stream):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": ASK, "max_tokens": 5, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert "structured_outputs.json" in error["message"]


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.function.name in (names or PARAMS)
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_tool_choice_required_and_named_on_chat(server):
    client = server.client().with_options(timeout=600)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS, tool_choice="required",
                                         max_tokens=120, temperature=0)
    choice = out.choices[0]
    check_calls(choice.message.tool_calls)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS, max_tokens=60, temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}})
    check_calls(out.choices[0].message.tool_calls, ["get_time"])
    # Streamed as OpenAI streams: the call's id and name first, then its arguments in deltas.
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model=MODEL, messages=ASK, tools=CHAT_TOOLS, tool_choice="required", max_tokens=120, temperature=0,
        stream=True) if c.choices and c.choices[0].delta.tool_calls]
    first = deltas[0].tool_calls[0]
    assert first.id and first.function.name == choice.message.tool_calls[0].function.name
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in deltas if d.tool_calls[0].index == 0)
    assert arguments == choice.message.tool_calls[0].function.arguments and len(deltas) > 2
    # And the next turn takes the call and its result back.
    call = choice.message.tool_calls[0]
    follow = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=CHAT_TOOLS,
                                            tool_choice="none", messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}])
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


def test_tool_choice_required_on_responses(server):
    client = server.client().with_options(timeout=600)
    out = client.responses.create(model=MODEL, input=ASK, tools=RESPONSES_TOOLS, tool_choice="required",
                                  max_output_tokens=120, temperature=0)
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and out.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
    with client.responses.stream(model=MODEL, input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=120,
                                 temperature=0, tool_choice={"type": "function", "name": "get_weather"}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather" and "".join(deltas) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # The call and its output go back as input items.
    follow = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=ASK + [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert follow.output_text
