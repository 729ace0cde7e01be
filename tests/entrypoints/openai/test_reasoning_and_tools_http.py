"""Reasoning and the model's own tool calls through the whole HTTP app and the official client, in process: a
scripted engine "generates" a Qwen3-style text (`<think>...</think>` then a Hermes `<tool_call>`) in small pieces,
so the test knows exactly what the model wrote and checks what each API makes of it, streamed and not."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from surge.entrypoints.openai.app import build_app
from surge.entrypoints.openai.options import ServerOptions

from scripted_engine import ScriptedEngine, serve

REASONING = "The user wants weather; a tool knows it."
ARGS = {"city": "Paris", "days": [1, 2]}
TEXT = f"<think>{REASONING}</think>\n\n<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': ARGS})}\n</tool_call>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def three_char_engine(model_dir) -> ScriptedEngine:
    """Answers every request with TEXT, cut into pieces of 3 characters, one output each."""
    return ScriptedEngine(model_dir, TEXT, max_model_len=512, piece_chars=3)


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with a template that renders tools, as Qwen's does."""
    from remote_server import CHATML, add_chat_template
    from tiny_models import make_tiny_model
    template = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}" + CHATML
    return add_chat_template(make_tiny_model("llama", tmp_path_factory.mktemp("tiny-tools")), template)


def run_with_client(model_dir, body):
    engine = three_char_engine(model_dir)
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    return serve(engine, options, body, timeout_s=60), engine


def test_chat_reasoning_content_and_tool_calls(tools_model_dir):
    async def body(client):
        whole = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
        chunks = [c async for c in await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                                                        stream=True)]
        return whole, chunks

    (whole, chunks), engine = run_with_client(tools_model_dir, body)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING and message.content is None
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
    assert whole.choices[0].finish_reason == "tool_calls"
    # The template saw the tools.
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in \
        engine.tokenizer.decode(engine.prompts[0])
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert reasoning == REASONING and not "".join(d.content or "" for d in deltas)
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert all(t.id is None and t.function.name is None for t in calls[1:]) and len(calls) > 2
    assert json.loads("".join(t.function.arguments for t in calls)) == ARGS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_responses_reasoning_item_and_function_call(tools_model_dir):
    flat = [{"type": "function", **t["function"]} for t in TOOLS]

    async def body(client):
        whole = await client.responses.create(model="m", input=ASK, tools=flat)
        async with client.responses.stream(model="m", input=ASK, tools=flat) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        return whole, events, final

    (whole, events, final), _ = run_with_client(tools_model_dir, body)
    for response in (whole, final):
        reasoning, call = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
        assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == ARGS
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types and "response.function_call_arguments.delta" in types
    assert types[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_auto_tool_choice_needs_the_servers_flags(tiny_model_dir):
    engine = three_char_engine(tiny_model_dir)
    app = build_app(engine, ["m"])

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return await http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})

    r = asyncio.run(main())
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


def test_responses_usage_counts_reasoning_tokens(tools_model_dir):
    """output_tokens_details.reasoning_tokens: the tokens up to the closing marker, streamed and not; none without
    a reasoning parser."""
    engine = ScriptedEngine(tools_model_dir, TEXT, max_model_len=512)  # the tokenizer's tokens: usage counts them
    reasoning_ids = engine.tokenizer.encode(f"<think>{REASONING}</think>", add_special_tokens=False)
    assert engine.ids[:len(reasoning_ids)] == reasoning_ids and len(engine.ids) > len(reasoning_ids)

    async def body(client):
        whole = await client.responses.create(model="m", input=ASK)
        async with client.responses.stream(model="m", input=ASK) as stream:
            [e async for e in stream]
            final = await stream.get_final_response()
        return whole, final

    for options, expected in ((ServerOptions(reasoning_parser="qwen3"), len(reasoning_ids)), (ServerOptions(), 0)):
        for response in serve(engine, options, body, timeout_s=60):
            assert response.usage.output_tokens == len(engine.ids)
            assert response.usage.output_tokens_details.reasoning_tokens == expected
