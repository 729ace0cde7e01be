"""The server's own options (`surge serve` flags beside the engine's): request limits, request-level chat templates,
tool-call and reasoning parsing.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from surge.entrypoints.openai.limits import ServerLimits
from surge.entrypoints.openai.reasoning import REASONING_PARSERS
from surge.entrypoints.openai.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class ServerOptions:
    limits: ServerLimits = field(default_factory=ServerLimits)
    # A chat template sent by the client is code the server runs: only when the operator trusts every client.
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse the model's own tool-call format
    tool_call_parser: str | None = None  # a name in TOOL_PARSERS
    reasoning_parser: str | None = None  # a name in REASONING_PARSERS (the engine's --reasoning-parser)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser={self.tool_call_parser!r} is unknown; choose one of "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: the format of the model's tool calls")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser={self.reasoning_parser!r} is unknown; choose one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}")

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("chat templates, tools and reasoning")
        g.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests bring their own chat_template (a Jinja program the server runs); off by "
                       "default, when a request's chat_template is a 400")
        g.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="tool_choice 'auto' (the default with tools): the model decides, and its tool calls are "
                       "parsed with --tool-call-parser")
        g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the model's tool-call format (hermes: <tool_call>{JSON}</tool_call>, as Qwen and Hermes "
                       "write them; deepseek_v3 (V3, R1), deepseek_v31, deepseek_v32, deepseek_v4: DeepSeek's)")
        ServerLimits.add_cli_args(p)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerOptions:
        return cls(limits=ServerLimits.from_cli_args(args),
                   trust_request_chat_template=args.trust_request_chat_template,
                   enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                   reasoning_parser=getattr(args, "reasoning_parser", None))
