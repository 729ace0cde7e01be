"""Reasoning parsers: a model's reasoning text apart from its answer (`reasoning_content`), one per marker table
entry of surge/structured_output/reasoning.py, so the server and the engine's grammars agree on where it ends."""
from __future__ import annotations

import functools
from collections.abc import Callable

from surge.entrypoints.openai.reasoning.markers_parser import MarkerReasoningParser
from surge.structured_output.reasoning import REASONING_MARKERS

REASONING_PARSERS: dict[str, Callable[[], MarkerReasoningParser]] = {
    name: functools.partial(MarkerReasoningParser, markers) for name, markers in REASONING_MARKERS.items()}

__all__ = ["REASONING_PARSERS", "MarkerReasoningParser"]
