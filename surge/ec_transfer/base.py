"""The encoder cache connector API: an encoder-only instance (ec_producer) saves each image's embeddings under its
content hash; a prefill or combined instance (ec_consumer) loads them before it would encode the image itself.

Keys are the image's identifier (sha256 of its processed pixels, surge/multimodal) prefixed with the model's
digest, so instances of another model or dtype never read each other's embeddings. A load that finds nothing, or
fails, returns None and the caller encodes locally: a store that is down costs encoder time, never a request.
"""
from __future__ import annotations

import hashlib

import torch

from surge.config import EngineConfig


def model_digest(config: EngineConfig) -> str:
    """What makes two instances' embeddings interchangeable: the checkpoint, architecture and dtype."""
    mc = config.model_config
    text = f"{mc.model}|{mc.architecture}|{str(mc.dtype).removeprefix('torch.')}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ECConnectorBase:
    """One per worker rank that runs the vision tower. save() runs on the producer once the embeddings are
    computed (complete when it returns: the request is answered after it); load() on the consumer, on the step's
    thread, when a prefill chunk first touches an image its encoder cache lacks."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.transfer_config = config.ec_transfer_config
        self.extra = dict(self.transfer_config.ec_connector_extra_config)
        self.prefix = model_digest(config)

    def key(self, identifier: str) -> str:
        return f"{self.prefix}-{identifier}"

    def save(self, identifier: str, embeds: torch.Tensor) -> None:
        raise NotImplementedError

    def load(self, identifier: str, device: torch.device) -> torch.Tensor | None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


def refuse_unknown(name: str, extra: dict, known: tuple[str, ...]) -> None:
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown ec_connector_extra_config keys {unknown}; known: {', '.join(known)}")
