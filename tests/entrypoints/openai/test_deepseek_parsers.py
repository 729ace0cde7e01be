"""DeepSeek's tool-call formats (V3 / R1, V3.1, V3.2 and V4's DSML) and V4's reasoning against plain references: the
text is written from known calls by a plain writer of each format, and the parsed calls must be those calls
(`json.loads` of the arguments), whatever pieces the text streams in."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from surge.engine import deepseek_v4_prompt
from surge.entrypoints.openai.choice_output import ChoiceOutputParser
from surge.entrypoints.openai.tool_parsers import TOOL_PARSERS
from surge.entrypoints.openai.tools import parse_tools
from test_output_parsers import cuts_of, run

CALLS = [("get_weather", {"city": "Pa\"ris </｜DSML｜param", "units": ["c", {"nested": "}]\"{"}], "note": "多\nline"}),
         ("noop", {}), ("sum", {"xs": [1, 2.5, -3e2], "ok": True, "none": None, "n": 7})]
BEFORE = "I will check."


def v3_text(calls) -> str:
    body = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args)}\n```<｜tool▁call▁end｜>"
                     for name, args in calls)
    return f"{BEFORE}\n\n<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def v31_text(calls) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args)}<｜tool▁call▁end｜>" for name, args in calls)
    return f"{BEFORE}<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def dsml_text(calls, block: str) -> str:
    def parameter(k, v):
        raw = isinstance(v, str)
        return (f'<｜DSML｜parameter name="{k}" string="{str(raw).lower()}">{v if raw else json.dumps(v)}'
                "</｜DSML｜parameter>")
    invokes = "\n".join(f'<｜DSML｜invoke name="{name}">\n' + "\n".join(parameter(k, v) for k, v in args.items())
                        + "\n</｜DSML｜invoke>" for name, args in calls)
    return f"{BEFORE}\n\n<｜DSML｜{block}>\n{invokes}\n</｜DSML｜{block}>"


FORMATS = {"deepseek_v3": v3_text, "deepseek_v31": v31_text,
           "deepseek_v32": lambda calls: dsml_text(calls, "function_calls"),
           "deepseek_v4": lambda calls: dsml_text(calls, "tool_calls")}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(FORMATS)), n=st.integers(1, 3))
def test_deepseek_calls_streamed_equal_the_calls_written(data, name, n):
    text = FORMATS[name](CALLS[:n])
    content, calls, deltas = run(TOOL_PARSERS[name](), text, data.draw(cuts_of(len(text))))
    assert content == BEFORE
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[:n]
    for c in calls:  # each call's first delta is its id and name, nothing of it before
        first = next(d for d in deltas if d.id == c.id)
        assert first.name == c.name and first.arguments == ""
        assert deltas.index(first) == min(i for i, d in enumerate(deltas) if d.index == first.index)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_deepseek_text_without_calls_is_the_answer(name):
    text = "less < than <｜tool and <｜DSML｜ marks, and a last <"
    assert run(TOOL_PARSERS[name](), text, list(range(len(text))))[:2] == (text, [])


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_deepseek_arguments_stream_before_the_call_closes(name):
    text = FORMATS[name](CALLS[2:3])
    cut = text.index('"n"')  # inside the last argument's key
    parser = TOOL_PARSERS[name]()
    out = parser.feed(text[:cut])
    streamed = "".join(d.arguments for d in out.tool_calls)
    assert out.tool_calls[0].name == "sum" and streamed
    assert json.dumps(CALLS[2][1]).startswith(streamed.rstrip(", "))


def test_deepseek_v4_tool_calls_straight_from_reasoning():
    """V4 may open its DSML block without closing its reasoning: the reasoning ends there, the block is a call."""
    tools = parse_tools([{"type": "function", "function": {"name": "get_weather"}}], "auto", True, responses=False,
                        auto_enabled=True)
    text = "The user asks for weather." + dsml_text(CALLS[:1], "tool_calls").removeprefix(BEFORE)
    for pieces in ([text], [text[i:i + 4] for i in range(0, len(text), 4)]):
        parser = ChoiceOutputParser("deepseek_v4", tools, "deepseek_v4", prompt_opened_reasoning=True)
        deltas = [parser.feed(p) for p in pieces] + [parser.feed("", final=True)]
        assert "".join(d.reasoning for d in deltas) == "The user asks for weather.\n\n"
        assert not "".join(d.content for d in deltas)
        [call] = ChoiceOutputParser("deepseek_v4", tools, "deepseek_v4", True).parse(text).tool_calls
        assert (call.name, json.loads(call.arguments)) == CALLS[0]


def test_deepseek_v4_calls_rendered_in_history_parse_back():
    """An earlier call as V4's prompt writes it is what the V4 parser reads: the two sides of one format agree."""
    history = [{"role": "user", "content": "?"},
               {"role": "assistant", "content": BEFORE, "tool_calls": [
                   {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": args}}
                   for i, (name, args) in enumerate(CALLS)]}]
    prompt = deepseek_v4_prompt.render(history, thinking=False)
    turn = prompt.split("<｜Assistant｜></think>")[1].removesuffix(deepseek_v4_prompt.EOS)
    content, calls, _ = run(TOOL_PARSERS["deepseek_v4"](), turn, [7, 50, 51, 200])
    assert content == BEFORE
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
