"""Rotary position embedding: cos/sin tables per position, with the frequencies computed by transformers' own rope
init functions (`ROPE_INIT_FUNCTIONS`: every rope type HF defines), applied in HF's "rotate half" layout or GPT-J's.

cos and sin are precomputed for every position up to the model length and looked up by position. Like HF's rotary
embedding, they are multiplied by the `attention_factor` the init function returns (yarn's mscale, longrope's
scaling), and they cover the leading `rotary_dim` channels of a head (`partial_rotary_factor`).

Rope types whose frequencies depend on the sequence length (HF's `dynamic_rope_update`) get one table row per
position, the frequencies HF uses for the token at position p during its cached greedy generate, when the sequence
is p + 1 long (the new token's query and key are rotated with them; keys cached earlier keep theirs):
- "dynamic" (NTK): positions p < max_position_embeddings use the original frequencies; a later p uses the ones
  the init computes for seq_len = p + 1. HF grows its frequencies whenever the sequence passes the longest it has
  cached, and resets them to the original ones only when a forward's sequence is shorter than
  max_position_embeddings: for a prompt shorter than that its generate matches this table; a prompt at least that
  long keeps the frequencies of the longest sequence the module has seen since its last reset (state across
  requests, which Surge does not reproduce).
- "longrope": positions p < original_max_position_embeddings use the short factors, later ones the long factors
  (HF picks long when seq_len > original_max_position_embeddings, afresh at each forward).
Where HF runs a whole prompt longer than that threshold in one forward, it rotates every prompt token with the
frequencies of the whole prompt length; Surge keeps each position's own, so that a position's keys do not depend on
the request, the chunking of its prefill or the prefix cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import types

from surge.attention.backend import Prologue


def _default_init(config, device=None, seq_len=None, layer_type=None) -> tuple[torch.Tensor, float]:
    """The original rope: HF defines it per model (`compute_default_rope_parameters`); this is GPT-NeoX's, which
    honours partial_rotary_factor (Llama's ignores it, having no partial rotary)."""
    params = config.rope_parameters
    dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq.to(device), 1.0


def _init_functions() -> dict:
    """transformers' rope init functions, imported only for a rope type other than default: the engine core process
    of a default-rope model never imports transformers (~1.2 s of start-up)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS


def supported_rope_types() -> tuple[str, ...]:
    return ("default", *_init_functions())


def rope_parameters(tc, layer_type: str | None = None) -> dict:
    """The rope parameters of a transformers-normalized config (`rope_parameters`, which transformers >= 5 builds
    from older configs' rope_theta + rope_scaling too); per layer type where a model has two (Gemma 3). Also the
    model's `max_position_embeddings`, which some init functions read from the config (dynamic's threshold; yarn's
    and longrope's factor when the params have none)."""
    params = getattr(tc, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params)
    params.setdefault("rope_theta", getattr(tc, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    if getattr(tc, "max_position_embeddings", None) is not None:
        params.setdefault("max_position_embeddings", tc.max_position_embeddings)
    return params


def _rope_config(head_dim: int, params: dict):
    """The config the init functions read: these rope parameters (one layer type's, so no layer_type is passed),
    the head size and the model's max_position_embeddings where known."""
    rope = dict(params)
    rope.setdefault("rope_type", rope.get("type", "default"))
    max_position_embeddings = rope.pop("max_position_embeddings", None)
    # Attributes set after construction: the constructor validates the rope parameters (warnings, and a KeyError
    # listing missing ones); the init function, run next, names what it lacks itself.
    if rope["rope_type"] == "default":  # read by _default_init only
        config = types.SimpleNamespace()
    else:
        from transformers import PreTrainedConfig
        config = PreTrainedConfig()
    config.rope_parameters, config.head_dim = rope, head_dim
    config.hidden_size, config.num_attention_heads = head_dim, 1  # read (head_dim first) by some init functions
    if max_position_embeddings is not None:
        config.max_position_embeddings = max_position_embeddings
    return config


def _init(config, seq_len=None) -> tuple[torch.Tensor, float]:
    """inv_freq [rotary_dim // 2] (or [N, rotary_dim // 2] for a column of lengths) and the attention factor."""
    rope_type = config.rope_parameters["rope_type"]
    init = _default_init if rope_type == "default" else _init_functions().get(rope_type)
    if init is None:
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported; supported: "
                         f"{', '.join(supported_rope_types())}")
    try:
        with torch.device("cpu"):  # whatever the default device (a meta build included)
            inv_freq, attention_factor = init(config, torch.device("cpu"), seq_len=seq_len)
    except (KeyError, AttributeError) as e:  # a parameter the init function needs and the config lacks
        missing = e.args[0] if isinstance(e, KeyError) else e.name
        raise ValueError(f"rope_parameters.{missing} is required for rope_type={rope_type!r}") from None
    return inv_freq.float(), float(attention_factor)


def _per_position(config, inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """inv_freq per position [max_position, rotary_dim // 2]: the original frequencies, and for length-dependent
    rope types the scaled ones past the threshold (see the module docstring)."""
    params = config.rope_parameters
    rope_type = params["rope_type"]
    table = inv_freq.expand(max_position, -1)
    if "dynamic" in rope_type:  # HF's test (dynamic_rope_update): seq_len > max_position_embeddings grows
        start = config.max_position_embeddings
        if start < max_position:
            # One call for every later length, as HF's forward passes it: an int64 tensor (so float32 math).
            scaled, _ = _init(config, seq_len=torch.arange(start + 1, max_position + 1).unsqueeze(1))
            assert scaled.shape == (max_position - start, inv_freq.shape[-1]), scaled.shape
            table = torch.cat((table[:start], scaled))
    elif rope_type == "longrope":  # long factors once seq_len > original_max_position_embeddings
        start = params["original_max_position_embeddings"]
        if start < max_position:
            long, _ = _init(config, seq_len=start + 1)
            table = torch.cat((table[:start], long.expand(max_position - start, -1)))
    return table


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict, interleaved: bool = False,
                 rotary_dim: int | None = None) -> None:
        """head_dim: a head's size; params: rope_parameters(...) or a dict of the same keys; rotary_dim: the leading
        channels rotated, frequencies over them (default: what the init function returns for head_dim and the
        params' partial_rotary_factor); interleaved: GPT-J's layout (channel pairs), else NeoX's (halves)."""
        super().__init__()
        self.interleaved = interleaved
        if rotary_dim is not None:
            params = {**params, "partial_rotary_factor": 1.0}
            head_dim = rotary_dim
        config = _rope_config(head_dim, params)
        # The base frequencies are tiny and computed on the CPU even for a meta build, so a bad config fails there.
        inv_freq, self.attention_factor = _init(config)
        self.rotary_dim = 2 * inv_freq.shape[-1]
        if torch.get_default_device().type == "meta":
            # A skeleton whose tables are bound later (the weight cache): shapes only. Math on meta tensors runs
            # torch's Python meta kernels, whose first use imports ~1 s of modules.
            shape = (max_position, inv_freq.shape[-1])
            self.register_buffer("cos_cache", torch.empty(shape, dtype=torch.float32), persistent=False)
            self.register_buffer("sin_cache", torch.empty(shape, dtype=torch.float32), persistent=False)
            return
        # Computed on the CPU whatever the model's device: the same bits everywhere (a GPU's cos/sin differ in the
        # last place), so a disk load, a weight-cache daemon and a CPU test all hold identical tables.
        device = torch.get_default_device()
        with torch.device("cpu"):
            table = _per_position(config, inv_freq, max_position)
            freqs = torch.arange(max_position, dtype=torch.float32).unsqueeze(1) * table
            # HF scales cos and sin (so q and k) by the attention factor; times 1.0 is exact.
            cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        self.register_buffer("cos_cache", cos.to(device), persistent=False)  # [max_position, rotary_dim // 2]
        self.register_buffer("sin_cache", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]; the first rotary_dim channels rotated in this embedding's
        layout, the rest passed through. On CUDA rotated in place by a Triton kernel."""
        if q.is_cuda:
            from surge.kernels.rotary import apply_rotary
            apply_rotary(positions, q, k, self.cos_cache, self.sin_cache, interleaved=self.interleaved)
            return q, k
        return Prologue(positions, self.cos_cache, self.sin_cache, interleaved=self.interleaved).apply(q, k)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL, Qwen2.5-VL): positions [3, T] of (temporal, height, width); `mrope_section` splits a head's
    rotary_dim // 2 frequencies into three runs, and run i turns by axis i's position (HF's layout, not the
    interleaved one of Qwen3-VL). A text token has three equal positions, which is plain rope."""

    def __init__(self, head_dim: int, max_position: int, params: dict) -> None:
        params = dict(params)
        section = params.pop("mrope_section", None)
        if params.pop("mrope_interleaved", False):
            raise ValueError("rope_parameters.mrope_interleaved=True (Qwen3-VL's layout) is not supported yet")
        super().__init__(head_dim, max_position, params)
        half = self.rotary_dim // 2
        if not (isinstance(section, (list, tuple)) and len(section) == 3 and sum(section) == half):
            raise ValueError(f"rope_parameters.mrope_section={section!r} must be three counts of frequencies summing "
                             f"to rotary_dim // 2 = {half}")
        axis = torch.repeat_interleave(torch.arange(3, device="cpu"), torch.tensor(section, device="cpu"))
        self.register_buffer("axis", axis.to(torch.get_default_device()), persistent=False)  # [half]: each's axis

    def rows(self, positions: torch.Tensor) -> RopeRows:
        """The step's rotary rows: cos/sin [T, rotary_dim // 2] of each token's own three positions, looked up by
        token index (so the attention prologue and its kernels, which index a table by position, take them as
        they are). One gather per step, shared by every layer; CUDA-graph safe."""
        index = positions.index_select(0, self.axis).T  # [T, half]: the position each frequency turns by
        return RopeRows(torch.arange(positions.shape[1], device=positions.device),
                        self.cos_cache.gather(0, index), self.sin_cache.gather(0, index))


@dataclass
class RopeRows:
    """Rotary tables with one row per token of a step, and the index (0..T-1) that picks each token's row."""
    index: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
