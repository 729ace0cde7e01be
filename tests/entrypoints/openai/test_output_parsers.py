"""Tool-call and reasoning parsers against plain references: the calls are what `json.loads` reads between the
markers, the reasoning what `str.partition` finds between them, and any split of the text into streamed pieces
gives the same result as the whole text at once (the streaming contract: name first, then argument deltas)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from surge.entrypoints.openai.choice_output import ChoiceOutputParser
from surge.entrypoints.openai.reasoning import REASONING_PARSERS
from surge.entrypoints.openai.tool_parsers import TOOL_PARSERS, merge_calls
from surge.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from surge.entrypoints.openai.tools import parse_tools
from surge.structured_output.reasoning import REASONING_MARKERS

CALLS = [("get_weather", {"city": "Paris", "units": ["c", {"nested": "}]\"{"}]}), ("noop", {}),
         ("sum", {"xs": [1, 2.5, -3e2], "ok": True, "none": None})]


def hermes_text(calls, before="I will check.", between="\n", style=0) -> str:
    parts = []
    for name, args in calls:
        body = {"name": name, "arguments": args} if style == 0 else {"arguments": args, "name": name}
        parts.append(f"<tool_call>\n{json.dumps(body, indent=style or None)}\n</tool_call>")
    return before + ("\n" if before else "") + between.join(parts)


def run(parser, text: str, cuts: list[int]):
    """Feeds text in pieces cut at `cuts`; returns (content, calls, every delta)."""
    bounds = [0] + sorted(set(c for c in cuts if 0 < c < len(text))) + [len(text)]
    content, deltas = "", []
    for a, b in zip(bounds, bounds[1:]):
        out = parser.feed(text[a:b])
        content, deltas = content + out.content, deltas + out.tool_calls
    out = parser.feed("", final=True)
    return content + out.content, merge_calls(deltas + out.tool_calls), deltas + out.tool_calls


def cuts_of(text_len: int):
    return st.lists(st.integers(0, text_len), max_size=30)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), style=st.sampled_from([0, 2]), n=st.integers(1, 3))
def test_hermes_streamed_equals_whole(data, style, n):
    text = hermes_text(CALLS[:n], style=style)
    content, calls, deltas = run(TOOL_PARSERS["hermes"](), text, data.draw(cuts_of(len(text))))
    assert content == "I will check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args) for name, args in CALLS[:n]]
    for c in calls:  # each call's first delta is its id and name, with no arguments yet
        first = next(d for d in deltas if d.id == c.id)
        assert first.name == c.name and first.arguments == ""
        if style == 0:  # name before arguments: nothing of the call comes before its name
            assert deltas.index(first) == min(i for i, d in enumerate(deltas) if d.index == first.index)


def test_hermes_arguments_stream_before_the_call_closes():
    text = hermes_text(CALLS[:1], before="")
    parser = TOOL_PARSERS["hermes"]()
    streamed = [parser.feed(text[:i + 1]) if i == 0 else parser.feed(text[i:i + 1]) for i in range(len(text) - 20)]
    arguments = "".join(d.arguments for out in streamed for d in out.tool_calls)
    assert arguments and json.dumps(CALLS[0][1]).startswith(arguments)


@pytest.mark.parametrize("text, content", [
    ("no calls at all", "no calls at all"),
    ("a <tool_call> not json </tool_call> b", "a <tool_call> not json </tool_call> b"),
    ('x <tool_call>{"arguments": {}}</tool_call>', 'x <tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("less < than <tool_ca", "less < than <tool_ca"),  # a marker's start, then the end: text after all
])
def test_hermes_text_that_is_not_a_call_is_kept(text, content):
    got, calls, _ = run(TOOL_PARSERS["hermes"](), text, list(range(len(text))))
    assert (got, calls) == (content, [])


def test_hermes_call_cut_short_keeps_what_was_read():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'
    _, calls, _ = run(TOOL_PARSERS["hermes"](), text, [5, 17, 30])
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": [1, 2')]


@settings(max_examples=100, deadline=None)
@given(data=st.data(), n=st.integers(1, 3))
def test_required_array_streamed_equals_json_loads(data, n):
    text = json.dumps([{"name": name, "parameters": args} for name, args in CALLS[:n]])
    content, calls, _ = run(RequiredToolParser(), text, data.draw(cuts_of(len(text))))
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c["name"], c["parameters"])
                                                                  for c in json.loads(text)]


def test_named_function_is_all_arguments():
    text = json.dumps(CALLS[0][1])
    _, calls, deltas = run(NamedToolParser("get_weather"), text, [3, 9])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [CALLS[0]]
    assert deltas[0].name == "get_weather" and deltas[0].arguments == ""


REASONING = "Let me think: 2 + 2 < 5, so </thi... no, it is four."


@settings(max_examples=100, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(REASONING_PARSERS)), opened=st.booleans(),
       prompt_opened=st.booleans())
def test_reasoning_split_equals_partition(data, name, opened, prompt_opened):
    """opened: the output opens with <think>; prompt_opened: the prompt ends inside the reasoning (read only by the
    parsers whose template decides in the prompt, DeepSeek V3.1 / V4)."""
    text = ("<think>" if opened else "") + REASONING + "</think>\n\nThe answer is 4."
    bounds = sorted(set(data.draw(cuts_of(len(text)))) | {0, len(text)})
    markers = REASONING_MARKERS[name]
    parser = REASONING_PARSERS[name](prompt_opened=prompt_opened and markers.prompt_decides)
    reasoning = content = ""
    for a, b in zip(bounds, bounds[1:]):
        r, c = parser.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = parser.feed("", final=True)
    reasoning, content = reasoning + r, content + c
    if markers.prompt_decides:  # the prompt ended in <think> (thinking mode) or </think> (chat mode)
        inside = prompt_opened
    else:  # DeepSeek-R1's template opens the reasoning in the prompt; Qwen3's output opens it
        inside = opened or markers.starts_inside
    if inside:
        before, _, after = text.removeprefix("<think>").partition("</think>")
        assert (reasoning, content) == (before, after.lstrip())
    else:  # thinking is off: all of it is the answer
        assert (reasoning, content) == ("", text)


def test_reasoning_then_tool_call():
    tools = parse_tools([{"type": "function", "function": {"name": "get_weather"}}], "auto", True, responses=False,
                        auto_enabled=True)
    parser = ChoiceOutputParser("qwen3", tools, "hermes")
    text = "<think>Weather needs a tool.</think>\n" + hermes_text(CALLS[:1], before="")
    parsed = parser.parse(text)
    assert parsed.reasoning == "Weather needs a tool." and parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [CALLS[0]]
    assert parser.finish_reason("stop") == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first():
    tools = parse_tools([{"type": "function", "function": {"name": n}} for n, _ in CALLS], "auto", False,
                        responses=False, auto_enabled=True)
    parsed = ChoiceOutputParser(None, tools, "hermes").parse(hermes_text(CALLS))
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]


def test_forced_schemas_follow_the_tools():
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "noop"}}]
    named = parse_tools(tools, {"type": "function", "function": {"name": "get_weather"}}, True, responses=False,
                        auto_enabled=False)
    assert named.structured_outputs().json == params
    required = parse_tools(tools, "required", False, responses=False, auto_enabled=False).structured_outputs().json
    assert required["maxItems"] == 1 and required["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [["get_weather"], ["noop"]]
    assert required["items"]["anyOf"][0]["properties"]["parameters"] == params
    flat = [{"type": "function", "name": "get_weather", "parameters": params}]
    assert parse_tools(flat, "required", True, responses=True, auto_enabled=False).tools[0].parameters == params
