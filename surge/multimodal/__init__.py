"""Multimodal inputs as the engine carries them: one `MultiModalFeature` per image of a prompt (its processed
pixels, the span of placeholder tokens its embeddings replace, the content hash that keys the prefix and encoder
caches, and for patch-sequence towers such as Qwen2.5-VL's the image's patch grid)."""
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
    # (t, h, w) patches of a tower that takes an image as a patch sequence (Qwen2-VL family: pixels are
    # [t * h * w, patch values]); its embeddings and the M-RoPE positions of its span follow from it. Empty otherwise.
    grid_thw: list[int] = []

    @staticmethod
    def of(pixel_values: torch.Tensor, offset: int, length: int, grid_thw: list[int] | None = None
           ) -> MultiModalFeature:
        pixel_values = pixel_values.contiguous()
        raw = pixel_values.numpy().tobytes()
        shape = list(pixel_values.shape)
        grid = [int(n) for n in grid_thw] if grid_thw is not None else []
        digest = hashlib.sha256(repr((shape, grid)).encode() + raw).hexdigest()
        return MultiModalFeature(digest, offset, length, raw, shape, str(pixel_values.dtype).removeprefix("torch."),
                                 grid)

    def pixel_values(self, device: torch.device | None = None) -> torch.Tensor:
        t = torch.frombuffer(bytearray(self.pixels), dtype=getattr(torch, self.dtype)).view(self.shape)
        return t if device is None else t.to(device)

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_keys(features: list[MultiModalFeature], start: int, end: int) -> tuple[str, ...]:
    """The identifiers of the features whose placeholders overlap prompt positions [start, end)."""
    return tuple(f.identifier for f in features if f.offset < end and f.end > start)
