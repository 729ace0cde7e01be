"""DeepSeek V4's prompt format. V4 checkpoints ship no Jinja chat template: their prompts follow DeepSeek's own
encoder (`encoding/encoding_dsv4.py` and its README in the checkpoint), written here again for Surge's
messages.

A prompt is BOS, the system text (with the tools' schemas and how to call them), `<｜User｜>` turns, and assistant
turns `[reasoning</think>]answer[\\n\\n<｜DSML｜tool_calls>...]<｜end▁of▁sentence｜>`; tool results are folded into the
next user turn as `<tool_result>` blocks. The turn to generate opens with `<｜Assistant｜><think>` in thinking mode
(the default) and `<｜Assistant｜></think>` in chat mode. Template kwargs (`chat_template_kwargs`): `thinking` /
`enable_thinking` (false: chat mode), `reasoning_effort` ("max" prefixes the prompt with DeepSeek's instruction for
it; "none" is chat mode), `drop_thinking` (default true: earlier turns' reasoning is left out, unless tools are given).
The instruction texts below are DeepSeek's, character for character: the model was trained on them.
"""
from __future__ import annotations

import json
from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"

# The kwargs render() reads, as a Jinja template's variables are read (the server passes only these through).
TEMPLATE_VARIABLES = frozenset({"thinking", "enable_thinking", "reasoning_effort", "drop_thinking"})
# OpenAI's effort names: only "max" changes the prompt, "none" turns thinking off.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "max")

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")

TOOLS = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def render(conversation: list[dict], add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
           thinking: Any = None, enable_thinking: Any = None, reasoning_effort: str | None = None,
           drop_thinking: bool = True) -> str:
    """The prompt text of a conversation of {"role", "content": text, "tool_calls", "tool_call_id"} messages (roles
    system, user, assistant, tool); tools in the Chat API's shape."""
    thinking_mode = bool(thinking) or bool(enable_thinking) or (thinking is None and enable_thinking is None)
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort={reasoning_effort!r} is invalid; allowed: {', '.join(REASONING_EFFORTS)}")
    if reasoning_effort == "none":
        thinking_mode = False
    messages = _with_tools(conversation, tools)
    messages = _fold_tool_results(messages)
    # With tools, every turn's reasoning stays: a tool loop continues one line of thought.
    drop = drop_thinking and not any(m.get("tools") for m in messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    prompt = BOS + (REASONING_EFFORT_MAX if thinking_mode and reasoning_effort == "max" else "")
    for i, m in enumerate(messages):
        prompt += _turn(m, thinking_mode and (not drop or i > last_user))
        following = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if m["role"] == "user" and (following == "assistant" or following is None and add_generation_prompt):
            prompt += ASSISTANT + (THINK if thinking_mode and (not drop or i >= last_user) else END_THINK)
    return prompt


def _with_tools(conversation: list[dict], tools: list[dict] | None) -> list[dict]:
    """The tools go with the leading system message (a new one when there is none), as the system text's end."""
    messages = [dict(m) for m in conversation]
    if tools:
        if messages and messages[0].get("role") == "system":
            messages[0]["tools"] = tools
        else:
            messages.insert(0, {"role": "system", "content": "", "tools": tools})
    return messages


def _fold_tool_results(messages: list[dict]) -> list[dict]:
    """V4 has no tool role: tool results and the user's text that follows them, in a row, are one user turn of
    parts joined by blank lines, the results in the order of the calls they answer."""
    out: list[dict] = []
    call_order: dict[str, int] = {}
    for m in messages:
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"role {role!r} is not one DeepSeek V4's prompt format takes: system, user, assistant, "
                             "tool")
        if role == "assistant" and m.get("tool_calls"):
            call_order = {c.get("id"): i for i, c in enumerate(m["tool_calls"]) if c.get("id")}
        if role not in ("user", "tool"):
            out.append(m)
            continue
        part = (f"<tool_result>{_text(m.get('content'))}</tool_result>", call_order.get(m.get("tool_call_id"), 0)) \
            if role == "tool" else (_text(m.get("content")), None)
        if out and "parts" in out[-1]:
            out[-1]["parts"].append(part)
        else:
            out.append({"role": "user", "parts": [part]})
    for m in out:
        if "parts" in m:
            results = iter(sorted((p for p in m["parts"] if p[1] is not None), key=lambda p: p[1]))
            m["content"] = "\n\n".join(next(results)[0] if order is not None else text
                                       for text, order in m.pop("parts"))
    return out


def _turn(m: dict, with_reasoning: bool) -> str:
    role = m["role"]
    if role == "system":
        tools = m.get("tools")
        schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools or [])
        return _text(m.get("content")) + ("\n\n" + TOOLS.replace("{schemas}", schemas) if tools else "")
    if role == "user":
        return USER + _text(m.get("content"))
    reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
    calls = ""
    if m.get("tool_calls"):
        invokes = "\n".join(_invoke(c["function"]) for c in m["tool_calls"])
        calls = f"\n\n<{DSML}tool_calls>\n{invokes}\n</{DSML}tool_calls>"
    return (reasoning + END_THINK if with_reasoning else "") + _text(m.get("content")) + calls + EOS


def _invoke(function: dict) -> str:
    """One earlier call in DSML: string arguments as they are, the others as JSON."""
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of the call to {function.get('name')!r} must be a JSON object")
    parameters = "\n".join(
        f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f'{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{DSML}parameter>'
        for k, v in arguments.items())
    return f'<{DSML}invoke name="{function["name"]}">\n{parameters}\n</{DSML}invoke>'


# Text parts as Chat (`text`) and the Responses API (`input_text`, `output_text`) write them: the server flattens
# them before rendering (entrypoints/openai/content.py); surge.LLM.chat passes them as they are.
_TEXT_PARTS = ("text", "input_text", "output_text")


def _text(content: Any) -> str:
    """A message's text: a string, None (empty), or text parts joined by newlines as the server joins them."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise ValueError(f"DeepSeek V4's prompt format takes a message's content as text or text parts "
                     f"({', '.join(_TEXT_PARTS)})")
