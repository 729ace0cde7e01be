"""Request and response bodies of the pooling routes, in vLLM's shapes: /v1/embeddings (OpenAI's), /score,
/rerank (Jina's and Cohere's), /classify."""
from __future__ import annotations

from typing import Any

import msgspec

from surge.entrypoints.openai.protocol import UsageInfo


# ---- requests ----
class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[Any]  # a string, token ids, or a list of either (checked in pooling.py)
    encoding_format: str = "float"  # or "base64": little-endian float32 bytes
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True


class ClassificationRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[Any]
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True


class ScoreRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    text_1: str | list[Any]
    text_2: str | list[Any]
    truncate_prompt_tokens: int | None = None


class RerankRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0: every document
    truncate_prompt_tokens: int | None = None
    return_documents: bool = True


# ---- responses ----
class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
    object: str = "list"


class ClassificationData(msgspec.Struct):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int
    object: str = "classification"


class ClassificationResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo
    object: str = "list"


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo
    object: str = "list"


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int
    prompt_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
