"""Output objects in the shape vLLM users know: RequestOutput holding CompletionOutputs; PoolingRequestOutput
(and its embedding, classification and scoring views) for pooling models."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank of this token among the vocabulary
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled / prompt token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # the first prompt token has no logprob: None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    kv_transfer_params: dict | None = None  # the KV connector's, once finished (a prefill instance's for its decode)


# ---- pooling (runner="pooling"): vLLM's shapes ----

@dataclass
class PoolingOutput:
    data: torch.Tensor  # the pooled output: an embedding, or class probabilities


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: Any  # PoolingOutput, or a task's view of it (EmbeddingOutput, ClassificationOutput, ScoringOutput)
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> EmbeddingOutput:
        return EmbeddingOutput(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> ClassificationOutput:
        return ClassificationOutput(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> ScoringOutput:
        if output.data.numel() != 1:
            raise ValueError(f"a score is one value; the model gave {output.data.numel()}")
        return ScoringOutput(float(output.data.item()))


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    @staticmethod
    def from_base(out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(out.request_id, EmbeddingOutput.from_base(out.outputs), out.prompt_token_ids,
                                      out.finished, out.num_cached_tokens)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    @staticmethod
    def from_base(out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return ClassificationRequestOutput(out.request_id, ClassificationOutput.from_base(out.outputs),
                                           out.prompt_token_ids, out.finished, out.num_cached_tokens)


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    @staticmethod
    def from_base(out: PoolingRequestOutput) -> ScoringRequestOutput:
        return ScoringRequestOutput(out.request_id, ScoringOutput.from_base(out.outputs), out.prompt_token_ids,
                                    out.finished, out.num_cached_tokens)
