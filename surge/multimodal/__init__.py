"""Multimodal inputs as the engine carries them: one `MultiModalFeature` per image of a prompt (its processed
pixels, the span of placeholder tokens its embeddings replace, and the content hash that keys the prefix and encoder
caches)."""
from __future__ import annotations

import hashlib

import msgspec
import torch


class MultiModalFeature(msgspec.Struct, array_like=True, gc=False):
    identifier: str  # sha256 of the processed pixels: equal images share embeddings and KV, different ones never do
    offset: int  # prompt position of its first placeholder token
    length: int  # placeholder tokens: rows of its embeddings
    pixels: bytes  # the processor's pixel values of this one image, raw
    shape: list[int]
    dtype: str = "float32"

    @staticmethod
    def of(pixel_values: torch.Tensor, offset: int, length: int) -> MultiModalFeature:
        pixel_values = pixel_values.contiguous()
        raw = pixel_values.numpy().tobytes()
        shape = list(pixel_values.shape)
        digest = hashlib.sha256(repr(shape).encode() + raw).hexdigest()
        return MultiModalFeature(digest, offset, length, raw, shape, str(pixel_values.dtype).removeprefix("torch."))

    def pixel_values(self, device: torch.device | None = None) -> torch.Tensor:
        t = torch.frombuffer(bytearray(self.pixels), dtype=getattr(torch, self.dtype)).view(self.shape)
        return t if device is None else t.to(device)

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_keys(features: list[MultiModalFeature], start: int, end: int) -> tuple[str, ...]:
    """The identifiers of the features whose placeholders overlap prompt positions [start, end)."""
    return tuple(f.identifier for f in features if f.offset < end and f.end > start)
