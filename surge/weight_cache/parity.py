"""The parity check: a model's tensors (every parameter and buffer, aliases included) by name, shape, dtype, stride
and a sha256 of their bytes, and the differences between two such fingerprints, e.g. a weight-cache model against
a disk load of the same checkpoint.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch
from torch import nn

from surge.weight_cache.tensor_table import named_tensors


class TensorFingerprint(NamedTuple):
    kind: str
    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...]
    sha256: str


def content_hash(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


def fingerprint(model: nn.Module) -> dict[str, TensorFingerprint]:
    return {name: TensorFingerprint(kind, tuple(t.shape), str(t.dtype).removeprefix("torch."), tuple(t.stride()),
                                    content_hash(t))
            for name, t, kind in named_tensors(model)}


def diff_fingerprints(ours: dict[str, TensorFingerprint], reference: dict[str, TensorFingerprint],
                      ours_name: str = "weight cache", reference_name: str = "disk") -> list[str]:
    """One line per difference; empty when both hold the same tensors."""
    lines = [f"{name}: only in the {reference_name} load" for name in sorted(set(reference) - set(ours))]
    lines += [f"{name}: only in the {ours_name} load" for name in sorted(set(ours) - set(reference))]
    for name in sorted(set(ours) & set(reference)):
        a, b = ours[name], reference[name]
        for field in TensorFingerprint._fields:
            if getattr(a, field) != getattr(b, field):
                lines.append(f"{name}: {field} {getattr(a, field)} ({ours_name}) != {getattr(b, field)} "
                             f"({reference_name})")
    return lines
