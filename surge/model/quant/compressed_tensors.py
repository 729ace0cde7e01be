"""compressed-tensors checkpoints (llm-compressor's format): each `config_groups` entry names the layers it
`targets` ("Linear", or `re:` regexes of module names) and its weight / input-activation schemes; `ignore` keeps
layers unquantized. Served here:
- float-quantized: fp8 weights per tensor, channel or block, with dynamic per-token / per-group or static
  per-tensor activations (FP8, FP8_DYNAMIC, FP8_BLOCK) -> surge/model/quant/fp8.py;
- pack-quantized: int4 / int8 weight-only, per group (32, 64, 128 ...) or per channel, symmetric or with zero
  points (W4A16, W8A16) -> surge/model/quant/wna16.py.
Anything else (int8 activations, NVFP4/MXFP4 packs, act-order g_idx) is refused naming the field.
"""
from __future__ import annotations

import re

from surge.model.quant import QuantConfig, _refuse, register_quant_method
from surge.model.quant.base import UNQUANTIZED, LinearMethod
from surge.model.quant.fp8 import Fp8LinearMethod
from surge.model.quant.wna16 import WNA16LinearMethod

_FORMATS = ("float-quantized", "pack-quantized", "naive-quantized")


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, cfg: dict) -> None:
        groups = cfg.get("config_groups") or {}
        if not groups:
            raise _refuse("config_groups", groups, "at least one quantization group")
        self.ignore = tuple(cfg.get("ignore") or ())
        default_format = cfg.get("format")
        self.groups: list[tuple[tuple[str, ...], LinearMethod]] = []
        for key, group in groups.items():
            targets = tuple(group.get("targets") or ())
            fmt = group.get("format") or default_format
            self.groups.append((targets, _method(f"config_groups.{key}", fmt, group)))
        self.skip = ("weight_shape",)  # the packed weight's original shape: known from the layer

    def method_for(self, module: str) -> LinearMethod:
        if self.ignored(module):
            return UNQUANTIZED
        for targets, method in self.groups:
            if any(t == "Linear" or (t.startswith("re:") and re.match(t[3:], module)) or t == module
                   for t in targets):
                return method
        return UNQUANTIZED

    def describe(self) -> str:
        return "compressed-tensors (" + "; ".join(m.describe() for _, m in self.groups) + ")"


def _method(where: str, fmt: str | None, group: dict) -> LinearMethod:
    weights, acts = group.get("weights"), group.get("input_activations")
    if not weights:
        raise _refuse(f"{where}.weights", weights, "a weight scheme")
    if fmt not in _FORMATS:
        raise _refuse(f"{where}.format", fmt, ", ".join(map(repr, _FORMATS)))
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations", group["output_activations"], "null")
    if weights.get("actorder") not in (None, "static"):
        raise _refuse(f"{where}.weights.actorder", weights.get("actorder"), "null, 'static'")
    if kind == "float" and bits == 8:
        return _fp8(where, weights, acts)
    if kind == "int" and bits in (4, 8) and acts is None and fmt == "pack-quantized":
        if strategy not in ("group", "channel"):
            raise _refuse(f"{where}.weights.strategy", strategy, "'group', 'channel' for int weights")
        group_size = weights.get("group_size") if strategy == "group" else None
        if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
            raise _refuse(f"{where}.weights.group_size", group_size, "a positive integer")
        return WNA16LinearMethod(bits=bits, group_size=group_size, symmetric=bool(weights.get("symmetric", True)))
    if kind == "int" and acts is not None:
        raise _refuse(f"{where}.input_activations", acts, "null for int weights (weight-only W4A16 / W8A16); int8 "
                      "activations are not supported")
    raise _refuse(f"{where}.weights", {k: weights.get(k) for k in ("type", "num_bits", "strategy")},
                  "float 8-bit (fp8), or int 4/8-bit pack-quantized")


def _fp8(where: str, weights: dict, acts: dict | None) -> Fp8LinearMethod:
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise _refuse(f"{where}.weights.strategy", strategy, "'tensor', 'channel', 'block'")
    block = None
    if strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2):
            raise _refuse(f"{where}.weights.block_structure", block, "[block_n, block_k]")
        block = tuple(block)
    if acts is None:
        raise _refuse(f"{where}.input_activations", acts, "fp8 activations (weight-only fp8 is not supported)")
    if acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise _refuse(f"{where}.input_activations", acts, "float 8-bit")
    a_strategy, dynamic = acts.get("strategy"), acts.get("dynamic")
    if dynamic and a_strategy == "token":
        activations = "token"
    elif dynamic and a_strategy == "group" and block is not None and acts.get("group_size") == block[1]:
        activations = "group"
    elif not dynamic and a_strategy == "tensor":
        activations = "static"
    else:
        raise _refuse(f"{where}.input_activations", {"strategy": a_strategy, "dynamic": dynamic},
                      "dynamic per-token, dynamic per-group (with block weights, group_size = block_k), static "
                      "per-tensor")
    if activations != "group" and block is not None:
        raise _refuse(f"{where}.input_activations.strategy", a_strategy, "'group' with block weights")
    return Fp8LinearMethod(strategy, activations, block)


register_quant_method("compressed-tensors", CompressedTensorsConfig)
