"""SamplingParams: what a request asks of the sampler and the output processor, validated on construction.

Field names and meanings follow vLLM's, so users can bring their code unchanged.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

_MAX_LOGPROBS = 20
# Temperatures below this are greedy (vLLM's threshold): logits / 1e-38 overflows to inf and the softmax to NaN.
_GREEDY_TEMPERATURE = 1e-5


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {allowed}")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language: exactly one of the fields below (vLLM's names and meanings).

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex; choice: one of these strings;
    grammar: an EBNF / Lark grammar. The engine compiles it through its grammar library (surge/structured_output/).
    """
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        _check(len(kinds) == 1, "structured_outputs", kinds,
               "set exactly one of json, regex, choice, grammar, json_object")
        _check(self.choice is None or (isinstance(self.choice, list) and self.choice
                                       and all(isinstance(c, str) for c in self.choice)),
               "structured_outputs.choice", self.choice, "must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value), f"structured_outputs.{name}", value,
                   "must be a non-empty string")
        _check(self.json is None or isinstance(self.json, (str, dict)), "structured_outputs.json", self.json,
               "must be a JSON schema, as a dict or JSON text")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None) \
            if not self.json_object else "json_object"


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context length; 0: compute the prompt only (scoring)
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    # For the KV connector (prefill/decode disaggregation): {"do_remote_decode": true} or a prefill's returned params.
    kv_transfer_params: dict | None = None
    # Filled by the engine from the model's generation config; not for users.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(_finite(self.temperature) and self.temperature >= 0.0, "temperature", self.temperature,
               "must be a finite number >= 0 (0, or anything below 1e-5, means greedy)")
        if self.temperature < _GREEDY_TEMPERATURE:
            self.temperature = 0.0
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "must be an integer >= 1, or 0 / -1 to disable")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0.0, "repetition_penalty",
               self.repetition_penalty, "must be a finite number > 0")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 0),
               "max_tokens", self.max_tokens, "must be an integer >= 1, 0 (the prompt only, e.g. for its "
               "prompt_logprobs), or None")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "must be an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"must be <= max_tokens ({self.max_tokens})")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "must be an integer or None")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be a non-empty string or a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be a list of non-negative token ids")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams, a dict or None")
        # A grammar that completes allows only EOS, which min_tokens would mask too: no token would be left.
        _check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens", self.min_tokens,
               "must be 0 with structured_outputs (the grammar decides where the output may end)")
        _check(self.kv_transfer_params is None or isinstance(self.kv_transfer_params, dict), "kv_transfer_params",
               self.kv_transfer_params, "must be an object or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= _MAX_LOGPROBS), name, value,
                   f"must be an integer in [0, {_MAX_LOGPROBS}], or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Repetition, presence or frequency penalty: sampling then reads the tokens generated so far."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def all_stop_token_ids(self) -> set[int]:
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self._eos_token_ids)
        return ids

    def clone(self, **overrides) -> SamplingParams:
        return dataclasses.replace(self, **overrides)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
