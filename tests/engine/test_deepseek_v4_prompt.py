"""DeepSeek V4's prompt format against prompts written out by hand from the format's README (the checkpoint's
encoding/README.md): BOS, turns, the generation prompt's <think> or </think>, earlier reasoning dropped or kept, tool
results folded into the next user turn in call order, and the kwargs that choose among them."""
from __future__ import annotations

import pytest

from surge.engine.deepseek_v4_prompt import REASONING_EFFORT_MAX, render

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TURNS = [{"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
         {"role": "user", "content": "What is 2+2?"}]


def test_readme_example_thinking_by_default():
    prompt = render([SYSTEM, {"role": "user", "content": "What is 2+2?"}])
    assert prompt == f"{B}You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>"


@pytest.mark.parametrize("kwargs", [{"thinking": False}, {"enable_thinking": False}, {"reasoning_effort": "none"}])
def test_chat_mode(kwargs):
    assert render(TURNS, **kwargs) == (f"{B}<｜User｜>Hi<｜Assistant｜></think>Hello!{E}<｜User｜>What is 2+2?"
                                       "<｜Assistant｜></think>")


def test_earlier_reasoning_is_dropped_unless_asked_or_tools():
    assert render(TURNS) == f"{B}<｜User｜>Hi<｜Assistant｜></think>Hello!{E}<｜User｜>What is 2+2?<｜Assistant｜><think>"
    kept = f"{B}<｜User｜>Hi<｜Assistant｜><think>Greet back.</think>Hello!{E}<｜User｜>What is 2+2?<｜Assistant｜><think>"
    assert render(TURNS, drop_thinking=False) == kept
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = render(TURNS, tools=tools)
    assert with_tools.endswith(kept.removeprefix(B))
    assert with_tools.startswith(f"{B}\n\n## Tools\n\n") and '\n{"name": "f", "parameters": {"type": "object"}}\n' \
        in with_tools


def test_tools_join_the_system_text():
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    prompt = render([SYSTEM, {"role": "user", "content": "x"}], tools=tools)
    assert prompt.startswith(f"{B}You are a helpful assistant.\n\n## Tools\n\n")
    assert prompt.count("## Tools") == 1


def test_tool_results_fold_into_one_user_turn_in_call_order():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {"s": "x", "n": [1]}}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    conversation = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "tool", "tool_call_id": "b", "content": "B"},
                    {"role": "tool", "tool_call_id": "a", "content": "A"}, {"role": "user", "content": "then?"}]
    dsml = "｜DSML｜"
    expected = (f"{B}<｜User｜>go<｜Assistant｜></think>\n\n<{dsml}tool_calls>\n<{dsml}invoke name=\"f\">\n"
                f"<{dsml}parameter name=\"s\" string=\"true\">x</{dsml}parameter>\n"
                f"<{dsml}parameter name=\"n\" string=\"false\">[1]</{dsml}parameter>\n</{dsml}invoke>\n"
                f"<{dsml}invoke name=\"g\">\n\n</{dsml}invoke>\n</{dsml}tool_calls>{E}"
                "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nthen?<｜Assistant｜></think>")
    assert render(conversation, thinking=False) == expected


def test_reasoning_effort_max_prefixes_the_prompt():
    conversation = [SYSTEM, {"role": "user", "content": "x"}]
    assert render(conversation, reasoning_effort="max") == B + REASONING_EFFORT_MAX + render(conversation)[len(B):]
    assert render(conversation, reasoning_effort="high") == render(conversation)
    assert render(conversation, reasoning_effort="max", thinking=False) == render(conversation, thinking=False)
    with pytest.raises(ValueError, match="reasoning_effort='extreme' is invalid"):
        render(conversation, reasoning_effort="extreme")


def test_text_parts_and_generation_prompt():
    parts = [{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}, {"type": "text", "text": "c"}]
    assert render([{"role": "user", "content": parts}]) == render([{"role": "user", "content": "a\nb\nc"}])
    assert render([{"role": "user", "content": "x"}], add_generation_prompt=False) == f"{B}<｜User｜>x"
    with pytest.raises(ValueError, match="role 'latest_reminder'"):
        render([{"role": "latest_reminder", "content": "x"}])
