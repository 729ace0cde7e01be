"""PoolingParams: what a pooling request (embed, classify, score) asks of the pooler, validated on construction.

Field names and meanings follow vLLM's. Defaults left as None are filled from the model's pooler config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score", "encode")


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"PoolingParams.{name}={value!r} is invalid: {allowed}")


@dataclass
class PoolingParams:
    # Keep only the last k prompt tokens (-1: up to max_model_len); None: a longer prompt is refused, never cut.
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None  # Matryoshka: the first `dimensions` values of the embedding (then normalized)
    normalize: bool | None = None  # embed: L2-normalize (None: the model's pooler config, normalize by default)
    use_activation: bool | None = None  # classify / score: sigmoid (one label) or softmax (None: yes)
    task: str | None = None  # embed, classify, score, encode; set by the LLM method or server route

    def __post_init__(self) -> None:
        _check(self.truncate_prompt_tokens is None or (isinstance(self.truncate_prompt_tokens, int) and not
                                                       isinstance(self.truncate_prompt_tokens, bool) and
                                                       (self.truncate_prompt_tokens >= 1
                                                        or self.truncate_prompt_tokens == -1)),
               "truncate_prompt_tokens", self.truncate_prompt_tokens, "must be an integer >= 1, -1 or None")
        _check(self.dimensions is None or (isinstance(self.dimensions, int) and not isinstance(self.dimensions, bool)
                                           and self.dimensions >= 1),
               "dimensions", self.dimensions, "must be an integer >= 1 or None")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, bool), name, value, "must be true, false or None")
        _check(self.task is None or self.task in POOLING_TASKS, "task", self.task,
               f"must be one of {', '.join(POOLING_TASKS)}")

    def clone(self, **overrides) -> PoolingParams:
        return dataclasses.replace(self, **overrides)
