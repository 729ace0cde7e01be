"""Rotary position embedding (HF "rotate half" layout) with default, linear and llama3 frequency scaling.

cos/sin are precomputed for every position up to the model length and looked up by position.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from surge.kernels.reference import rotate_half

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(tc, layer_type: str | None = None) -> dict:
    """The rope parameters of a transformers-normalized config (`rope_parameters`, which transformers >= 5 builds
    from older configs' rope_theta + rope_scaling too); per layer type where a model has two (Gemma 3)."""
    params = getattr(tc, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params)
    params.setdefault("rope_theta", getattr(tc, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type={kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict, interleaved: bool = False,
                 rotary_dim: int | None = None) -> None:
        """head_dim: a head's size; rotary_dim: the leading channels rotated (default: head_dim times the params'
        partial_rotary_factor, 1.0 unless given); interleaved: GPT-J's layout (channel pairs), else NeoX's
        (halves)."""
        super().__init__()
        self.interleaved = interleaved
        if rotary_dim is None:
            rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        head_dim = self.rotary_dim = rotary_dim
        if torch.get_default_device().type == "meta":
            # A skeleton whose tables are bound later (the weight cache): shapes only. Math on meta tensors runs
            # torch's Python meta kernels, whose first use imports ~1 s of modules.
            shape = (max_position, head_dim // 2)
            self.register_buffer("cos_cache", torch.empty(shape, dtype=torch.float32), persistent=False)
            self.register_buffer("sin_cache", torch.empty(shape, dtype=torch.float32), persistent=False)
            return
        # Computed on the CPU whatever the model's device: the same bits everywhere (a GPU's cos/sin differ in the
        # last place), so a disk load, a weight-cache daemon and a CPU test all hold identical tables.
        device = torch.get_default_device()
        with torch.device("cpu"):
            inv_freq = _inv_freq(head_dim, params)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_cache", freqs.cos().to(device), persistent=False)  # [max_position, head_dim // 2]
        self.register_buffer("sin_cache", freqs.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]. On CUDA rotated in place by a Triton kernel."""
        if q.is_cuda:
            from surge.kernels.rotary import apply_rotary
            apply_rotary(positions, q, k, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return rotate_half(q, cos, sin), rotate_half(k, cos, sin)
