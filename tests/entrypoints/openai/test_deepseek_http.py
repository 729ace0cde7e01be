"""DeepSeek V4 and V3.1 serving through the whole HTTP app and the official client, in process: a tiny checkpoint
whose tokenizer has DeepSeek's marker tokens renders the prompt (V4: its own prompt format, no Jinja template; V3.1: a
template that, like V3.1's, ends the prompt with <think> or </think> by chat_template_kwargs), and a scripted engine
"generates" a known text token by token; the test checks what each API makes of it, streamed and not."""
from __future__ import annotations

import json

import pytest

from surge.engine import deepseek_v4_prompt
from surge.entrypoints.openai.options import ServerOptions

from scripted_engine import ScriptedEngine, serve

REASONING = "The user wants weather; a tool knows it."
ARGS = {"city": "Paris", "days": [1, 2]}
V4_TEXT = (f"{REASONING}</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
           f"<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
           f"<｜DSML｜parameter name=\"days\" string=\"false\">[1, 2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
           f"</｜DSML｜tool_calls>")
V31_TEXT = (f"{REASONING}</think>Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            f"{json.dumps(ARGS)}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# A V3.1-like template: the generation prompt opens the reasoning only in thinking mode.
V31_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
                "{% elif m['role'] == 'assistant' %}<｜Assistant｜></think>{{ m['content'] }}{{ eos_token }}"
                "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<｜Assistant｜>{% if thinking %}<think>{% else %}</think>{% endif %}"
                "{% endif %}")


def token_scripted_engine(model_dir, text: str) -> ScriptedEngine:
    """`text` as the tokenizer's tokens, one output per token."""
    engine = ScriptedEngine(model_dir, text, max_model_len=4096)
    assert engine.tokenizer.decode(engine.ids) == text  # the tokenizer round-trips the markers
    return engine


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    from tiny_deepseek import with_deepseek_tokenizer
    from tiny_dsv4 import make_tiny_model
    return with_deepseek_tokenizer(make_tiny_model("deepseek-v4", tmp_path_factory.mktemp("tiny-dsv4-serve")))


@pytest.fixture(scope="module")
def v31_dir(tmp_path_factory):
    from tiny_deepseek import with_deepseek_tokenizer
    from tiny_models import make_tiny_model
    return with_deepseek_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("tiny-v31")), V31_TEMPLATE)


V4_OPTIONS = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="deepseek_v4", reasoning_parser="deepseek_v4")


def test_v4_chat_renders_its_prompt_format_and_parses_reasoning_and_dsml_calls(v4_dir):
    engine = token_scripted_engine(v4_dir, V4_TEXT)

    async def body(client):
        whole = await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
        chunks = [c async for c in await client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                                                        stream=True)]
        chat_mode = await client.chat.completions.create(model="m", messages=ASK,
                                                         extra_body={"chat_template_kwargs": {"thinking": False}})
        return whole, chunks, chat_mode

    whole, chunks, chat_mode = serve(engine, V4_OPTIONS, body)
    # The prompt is V4's own format (the checkpoint has no Jinja template), thinking mode by default.
    expected = deepseek_v4_prompt.render(ASK, tools=TOOLS)
    assert engine.prompt_text(0) == expected and expected.endswith("<｜User｜>Weather in Paris?<｜Assistant｜><think>")
    assert "## Tools" in expected and '{"name": "get_weather", "parameters": {"type": "object"}}' in expected
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING and message.content is None
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
    assert whole.choices[0].finish_reason == "tool_calls"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == REASONING
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather" and len(calls) > 2
    assert json.loads("".join(t.function.arguments for t in calls)) == ARGS
    # chat_template_kwargs {"thinking": false}: chat mode's prompt, and no reasoning in the answer.
    assert engine.prompt_text(2) == deepseek_v4_prompt.render(ASK, thinking=False)
    assert engine.prompt_text(2).endswith("<｜Assistant｜></think>")
    assert chat_mode.choices[0].message.model_extra.get("reasoning_content") is None
    assert chat_mode.choices[0].message.content.startswith(REASONING + "</think>")


def test_v4_responses_text_parts_render_as_chat_text(v4_dir):
    """input_text / output_text parts (an earlier assistant turn in `input`) render as Chat's text parts do."""
    engine = token_scripted_engine(v4_dir, V4_TEXT)
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    history = [{"role": "user", "content": [{"type": "input_text", "text": "Hi."}, {"type": "input_text", "text": "?"}]},
               {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
               {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    chat_history = [{"role": "user", "content": [{"type": "text", "text": "Hi."}, {"type": "text", "text": "?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                    {"role": "user", "content": "Weather in Paris?"}]

    async def body(client):
        whole = await client.responses.create(model="m", input=history, tools=flat)
        async with client.responses.stream(model="m", input=history, tools=flat) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        await client.chat.completions.create(model="m", messages=chat_history, tools=TOOLS)
        return whole, events, final

    whole, events, final = serve(engine, V4_OPTIONS, body)
    assert engine.prompt_text(0) == engine.prompt_text(1) == engine.prompt_text(2)
    # With tools every turn keeps its (here empty) reasoning: <think></think> before the earlier answer.
    assert engine.prompt_text(0).endswith("<｜User｜>Hi.\n?<｜Assistant｜><think></think>Hello.<｜end▁of▁sentence｜>"
                                          "<｜User｜>Weather in Paris?<｜Assistant｜><think>")
    for response in (whole, final):
        reasoning, call = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
        assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == ARGS
        # The reasoning's tokens: those up to and including </think>.
        num_reasoning = len(engine.tokenizer.encode(REASONING + "</think>", add_special_tokens=False))
        assert response.usage.output_tokens_details.reasoning_tokens == num_reasoning
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("thinking", [True, False])
def test_v31_template_decides_the_reasoning(v31_dir, thinking):
    """deepseek_v3: the output is reasoning first only when the template opened it (chat_template_kwargs
    {"thinking": true}); deepseek_v31 tool calls either way."""
    text = V31_TEXT if thinking else V31_TEXT.removeprefix(REASONING + "</think>")
    engine = token_scripted_engine(v31_dir, text)
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="deepseek_v31",
                            reasoning_parser="deepseek_v3")

    async def body(client):
        kwargs = dict(model="m", messages=ASK, tools=TOOLS, extra_body={"chat_template_kwargs": {"thinking": thinking}})
        whole = await client.chat.completions.create(**kwargs)
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
        return whole, chunks

    whole, chunks = serve(engine, options, body)
    assert engine.prompt_text(0).endswith("<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>")
    message = whole.choices[0].message
    assert message.model_extra.get("reasoning_content") == (REASONING if thinking else None)
    assert message.content == "Let me look."
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == (REASONING if thinking else "")
    assert "".join(d.content or "" for d in deltas) == "Let me look."
    assert json.loads("".join(t.function.arguments for d in deltas for t in d.tool_calls or [])) == ARGS
