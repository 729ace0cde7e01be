"""`tools`, `tool_choice` and `parallel_tool_calls` of a Chat or Responses request: checked, rendered through the
chat template, parsed from the output, and for "required" or a named function turned into the JSON schema the
grammar enforces, so the arguments always parse against the tool's parameters."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from surge.entrypoints.openai.errors import bad_request
from surge.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from surge.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from surge.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's function names (letters, digits, _ and -), 64 at most
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict | None

    def for_template(self) -> dict:
        """The Chat API's shape, which chat templates read."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else {"type": "object",
                                                                                        "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # none | auto | required | function
    function: str | None  # the named function when choice is "function"
    parallel: bool
    param: str  # where the grammar comes from, for errors

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template renders; with tool_choice "none" the model is not told of any tool."""
        return [t.for_template() for t in self.tools] if self.choice != "none" else None

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def structured_outputs(self) -> StructuredOutputsParams | None:
        # Compact JSON: blanks the grammar would allow anywhere cost tokens, and a small model can loop on them.
        if self.choice == "function":
            return StructuredOutputsParams(json=_parameters(self._tool(self.function)), disable_any_whitespace=True)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]},
                                                  "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    def parser(self, tool_call_parser: str | None) -> ToolParser | None:
        if self.choice == "function":
            return NamedToolParser(self.function)
        if self.choice == "required":
            return RequiredToolParser()
        if self.choice == "auto":
            return TOOL_PARSERS[tool_call_parser]()
        return None

    def _tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)


def _parameters(tool: Tool) -> dict:
    return tool.parameters if tool.parameters is not None else {"type": "object"}


def parse_tools(tools: list | None, tool_choice: Any, parallel_tool_calls: bool | None, *, responses: bool,
                auto_enabled: bool) -> ToolRequest | None:
    """The Chat shape (`{"type": "function", "function": {...}}`) or, with `responses`, the Responses API's flat one
    (`{"type": "function", "name": ...}`). None when the request has no tools and asks for none."""
    parsed = tuple(_tool(t, f"tools[{i}]", responses) for i, t in enumerate(tools or []))
    names = [t.name for t in parsed]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools: the function name {duplicate!r} is given twice", param="tools")
    if tool_choice is None:
        tool_choice = "auto" if parsed else "none"
    function = None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise bad_request(f"tool_choice={tool_choice!r} is invalid: one of {', '.join(CHOICES)}, or a function",
                              param="tool_choice")
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        named = tool_choice if responses else tool_choice.get("function")
        function = named.get("name") if isinstance(named, dict) else None
        shape = "{'type': 'function', 'name': NAME}" if responses else \
            "{'type': 'function', 'function': {'name': NAME}}"
        if not isinstance(function, str):
            raise bad_request(f"tool_choice must name its function as {shape}", param="tool_choice")
        if function not in names:
            raise bad_request(f"tool_choice names the function {function!r}, which is not among tools "
                              f"({', '.join(names) or 'none given'})", param="tool_choice")
        choice = "function"
    else:
        raise bad_request(f"tool_choice is invalid: one of {', '.join(CHOICES)}, or {{'type': 'function', ...}}",
                          param="tool_choice")
    if not parsed:
        if choice in ("required", "function"):
            raise bad_request(f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
        return None
    if choice == "auto" and not auto_enabled:
        raise bad_request('tool_choice "auto" (the default with tools) needs the server started with '
                          '--enable-auto-tool-choice and --tool-call-parser; "required" or a named function work '
                          'without them', param="tool_choice")
    return ToolRequest(parsed, choice, function, parallel_tool_calls is not False, "tool_choice")


def _tool(tool: Any, param: str, responses: bool) -> Tool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"{param}: only tools of type 'function' are supported, got {kind!r}", param=param)
    function = tool if responses else tool.get("function")
    where = param if responses else f"{param}.function"
    if not isinstance(function, dict):
        raise bad_request(f"{where} must be an object with a name", param=where)
    name, description, parameters = function.get("name"), function.get("description"), function.get("parameters")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.name={name!r} is invalid: 1 to 64 letters, digits, '_', '-', '.' or ':'",
                          param=f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", param=f"{where}.description")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.parameters must be a JSON schema object", param=f"{where}.parameters")
    return Tool(name, description, parameters)


def template_tool_calls(tool_calls: Any, param: str) -> list[dict]:
    """An assistant message's earlier `tool_calls` as chat templates read them: arguments as an object."""
    if not isinstance(tool_calls, list):
        raise bad_request(f"{param} must be a list", param=param)
    out = []
    for i, call in enumerate(tool_calls):
        where = f"{param}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                              param=where)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # templates that print the arguments take the text as it is
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out
