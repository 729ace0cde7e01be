"""Driving an EngineCore step by step in tests: an abort that lands while a step is in flight (async scheduling)."""
from __future__ import annotations

from surge.core.request import Request
from surge.engine.core import EngineCore
from surge.sampling_params import SamplingParams


def abort_while_in_flight(engine: EngineCore, params: SamplingParams) -> dict[str, list[int]]:
    """Requests a [5..9] and b [9, 8, 7]; three steps, then a is aborted with a step in flight; b runs to its end.
    Returns the tokens each received."""
    for rid, prompt in (("a", [5, 6, 7, 8, 9]), ("b", [9, 8, 7])):
        engine.add_request(Request(rid, prompt, params, engine.config.cache_config.block_size))
    got: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(3):
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert engine._in_flight is not None
    engine.abort_requests(["a"])
    for _ in range(50):  # bounded: b needs fewer steps than its max_tokens
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    return got
