"""The encoder cache: each image's embeddings, keyed by its content hash, from the step that first needs them until
every request using it has prefilled its placeholders; chunked prefill may split an image's span over several steps
and requests may share an image, and neither encodes it twice. With an EC connector that loads (encoder
disaggregation), an image's embeddings come from the encoder instance when it saved them, and are encoded here
otherwise (counted: a fallback)."""
from __future__ import annotations

import torch
from torch import nn

from surge.ec_transfer.base import ECConnectorBase
from surge.multimodal import MultiModalFeature


class EncoderCache:
    def __init__(self, device: torch.device, connector: ECConnectorBase | None = None) -> None:
        self.device = device
        self.connector = connector if connector is not None and connector.transfer_config.loads else None
        self.num_loaded = 0  # images whose embeddings the connector supplied (read and reset by the runner)
        self.num_fallbacks = 0  # images encoded here although the connector was asked for them
        self.embeds: dict[str, torch.Tensor] = {}  # identifier -> [length, hidden]
        self.users: dict[str, set[str]] = {}  # identifier -> requests whose placeholders are not all prefilled

    def encode(self, model: nn.Module, needed: list[tuple[str, MultiModalFeature]]) -> None:
        """Run the vision encoder once on every (request, feature) pair's image not cached yet, in one call: the
        model batches them as its tower allows (LLaVA by pixel shape, Qwen2.5-VL as one packed patch sequence)."""
        missing: dict[str, MultiModalFeature] = {}
        for request_id, f in needed:
            self.users.setdefault(f.identifier, set()).add(request_id)
            if f.identifier not in self.embeds:
                missing[f.identifier] = f
        if self.connector is not None:
            for identifier, f in list(missing.items()):
                rows = self.connector.load(identifier, self.device)
                if rows is not None and rows.shape[0] == f.length:
                    self.embeds[identifier] = rows
                    self.num_loaded += 1
                    del missing[identifier]
            self.num_fallbacks += len(missing)
        if not missing:
            return
        features = list(missing.values())
        for f, rows in zip(features, model.embed_images(features, self.device), strict=True):
            if rows.shape[0] != f.length:
                raise ValueError(f"an image's encoder output has {rows.shape[0]} rows but its prompt holds "
                                 f"{f.length} placeholder tokens")
            self.embeds[f.identifier] = rows

    def release(self, identifier: str, request_id: str) -> None:
        """The request has prefilled the image's last placeholder."""
        users = self.users.get(identifier)
        if users is not None:
            users.discard(request_id)
            if not users:
                del self.users[identifier]
                self.embeds.pop(identifier, None)

    def drop_requests(self, request_ids) -> None:
        """Finished (or aborted) requests release every image they held."""
        for identifier in [i for i, users in self.users.items() if users.intersection(request_ids)]:
            for rid in request_ids:
                self.release(identifier, rid)
