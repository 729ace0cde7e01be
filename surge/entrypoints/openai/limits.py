"""What one request may ask of the server: body size, JSON nesting, samples, stop strings, logprobs, integer ranges.

Limits are `surge serve` flags (their defaults are in `--help`); every check answers a 400 or 413 naming the field.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import numpy as np

from surge.entrypoints.openai.errors import APIError, bad_request

# Integers the engine carries in 64 bits (msgpack, torch generators); JSON integers have no bound of their own.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
MAX_LOGPROBS = 20  # OpenAI's and SamplingParams's bound on top logprobs


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 16 << 20
    max_json_depth: int = 64
    max_n: int = 128
    max_stop: int = 16  # stop strings per request
    max_stop_length: int = 256  # characters per stop string
    max_stop_token_ids: int = 256
    max_logprobs: int = MAX_LOGPROBS

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_n", "max_stop", "max_stop_length",
                     "max_stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value!r} is invalid: must be an integer >= 1")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs={self.max_logprobs!r} is invalid: must be in [0, {MAX_LOGPROBS}]")

    # ---- flags ----
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        d = ServerLimits
        g = p.add_argument_group("request limits (each answers a 400 or 413 naming the field)")
        g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                       help=f"largest request body (default: {d.max_body_bytes} bytes); larger ones get a 413")
        g.add_argument("--max-json-depth", type=int, default=d.max_json_depth,
                       help=f"deepest nesting of arrays and objects in a body (default: {d.max_json_depth})")
        g.add_argument("--max-n", type=int, default=d.max_n, help=f"samples per request, n (default: {d.max_n})")
        g.add_argument("--max-stop", type=int, default=d.max_stop,
                       help=f"stop strings per request (default: {d.max_stop})")
        g.add_argument("--max-stop-length", type=int, default=d.max_stop_length,
                       help=f"characters per stop string (default: {d.max_stop_length})")
        g.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
                       help=f"stop_token_ids per request (default: {d.max_stop_token_ids})")
        g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                       help=f"top logprobs per token, logprobs / top_logprobs (default and most: {MAX_LOGPROBS})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerLimits:
        return cls(max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth, max_n=args.max_n,
                   max_stop=args.max_stop, max_stop_length=args.max_stop_length,
                   max_stop_token_ids=args.max_stop_token_ids, max_logprobs=args.max_logprobs)

    # ---- checks ----
    def check_depth(self, body: bytes) -> None:
        """A 400 when arrays and objects nest deeper than max_json_depth, found before any parser recurses."""
        if body.count(b"[") + body.count(b"{") <= self.max_json_depth:
            return  # cannot nest deeper than it has brackets
        depth = json_depth(body)
        if depth > self.max_json_depth:
            raise bad_request(f"the request body nests arrays and objects {depth} deep; at most "
                              f"{self.max_json_depth} is allowed (--max-json-depth)", code="json_too_deep")

    def check_body_size(self, size: int) -> None:
        if size > self.max_body_bytes:
            raise APIError(413, f"the request body has more than {self.max_body_bytes} bytes, the most this server "
                           "accepts (--max-body-bytes)", code="request_too_large")

    def check_stop(self, stop: str | list[str] | None) -> None:
        strings = [stop] if isinstance(stop, str) else (stop or [])
        if len(strings) > self.max_stop:
            raise bad_request(f"stop has {len(strings)} strings; at most {self.max_stop} are allowed (--max-stop)",
                              param="stop")
        for i, s in enumerate(strings):
            if len(s) > self.max_stop_length:
                raise bad_request(f"stop[{i}] has {len(s)} characters; at most {self.max_stop_length} are allowed "
                                  "(--max-stop-length)", param="stop")

    def check_n(self, n: int) -> None:
        if not 1 <= n <= self.max_n:
            raise bad_request(f"n={n} is invalid: must be an integer in [1, {self.max_n}]", param="n")

    def check_logprobs(self, value: int, param: str) -> None:
        if not 0 <= value <= self.max_logprobs:
            raise bad_request(f"{param}={value} is invalid: must be in [0, {self.max_logprobs}]", param=param)


def check_int_range(value: int | None, param: str, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise bad_request(f"{param}={value} is out of range: must be an integer in [{low}, {high}]", param=param)


# A JSON string (escapes included); what is left between them is structure, numbers and literals.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text, without parsing it (vectorized: bodies are big)."""
    structure = np.frombuffer(_STRING.sub(b"0", body), np.uint8)
    steps = np.isin(structure, _OPEN).astype(np.int64) - np.isin(structure, _CLOSE).astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))
