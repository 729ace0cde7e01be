"""Quantized checkpoints: `quantization_config.quant_method` (or `--quantization` for online quantization of an
unquantized checkpoint) -> a QuantConfig, which gives each linear layer its LinearMethod by the layer's checkpoint
names (so `ignore` / `modules_to_not_convert` lists apply as the checkpoint writes them, and a merged q/k/v is
quantized only if its parts are, alike).

The model is built with its linear weights deferred (surge/model/layers/linear.py), then `quantize_model` assigns
the methods, which create the parameters on the device: a quantized model never allocates unquantized weights.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from surge.model.quant.base import UNQUANTIZED, UNQUANTIZED_MOE, LinearMethod, MoEMethod
from surge.model.quant.fp8 import Fp8LinearMethod


class QuantConfig:
    """A checkpoint's quantization: the method of each linear layer, by its checkpoint module names."""
    name = "none"
    ignore: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()  # checkpoint tensor names (last part) the layers do not load
    method: LinearMethod  # of every layer not ignored (configs whose layers differ override method_for)

    def method_for(self, module: str) -> LinearMethod:
        return UNQUANTIZED if self.ignored(module) else self.method

    def moe_method_for(self, module: str) -> MoEMethod:
        """The method of a mixture-of-experts layer whose checkpoint module (one expert's projection, or the stacked
        experts) is `module`: the expert counterpart of its linear method."""
        return self.method_for(module).moe_method()

    def ignored(self, module: str) -> bool:
        return any(_matches(module, pattern) for pattern in self.ignore)

    def describe(self) -> str:
        return f"{self.name} ({self.method.describe()})"


def _matches(module: str, pattern: str) -> bool:
    """compressed-tensors' `re:` regexes (matched from the start), else a module name, or a name's last parts
    ("lm_head", "mlp.gate"), or a parent ("model.layers.0.mlp"); `*` matches any one name part (gpt-oss's
    "model.layers.*.self_attn")."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if "*" in pattern:
        regex = r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
        return re.match(rf"(.*\.)?{regex}(\..*)?$", module) is not None
    return module == pattern or module.endswith("." + pattern) or module.startswith(pattern + ".")


def _refuse(field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"quantization_config.{field}={value!r} is not supported; supported: {supported}")


def _group_size(group: Any) -> int | None:
    """AWQ's and GPTQ's group_size: a positive integer, or -1 for one group per output channel (None)."""
    if not (isinstance(group, int) and (group > 0 or group == -1)):
        raise _refuse("group_size", group, "a positive integer, or -1 (per channel)")
    return group if group > 0 else None


class Fp8Config(QuantConfig):
    """HF's `fp8` (transformers FineGrainedFP8, DeepSeek-V3, Qwen3-FP8): weight_block_size [bn, bk] with 1 x bk
    dynamic activation groups, or per-tensor weights with dynamic per-token or static activations."""
    name = "fp8"

    def __init__(self, cfg: dict) -> None:
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _refuse("fmt", fmt, "'e4m3'")
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _refuse("activation_scheme", scheme, "'dynamic', 'static'")
        block = cfg.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                             for b in block)):
                raise _refuse("weight_block_size", block, "[block_n, block_k] of positive integers, or null")
            if scheme == "static":
                raise _refuse("activation_scheme", scheme, "'dynamic' with weight_block_size")
        self.ignore = tuple(cfg.get("modules_to_not_convert") or ())
        names = dict(scale_name="weight_scale_inv", input_scale_name="activation_scale")
        if block is not None:
            self.method = Fp8LinearMethod("block", "group", tuple(block), **names)
        else:
            self.method = Fp8LinearMethod("tensor", "static" if scheme == "static" else "token", None, **names)

    def describe(self) -> str:
        return self.method.describe()


class OnlineFp8Config(QuantConfig):
    """`--quantization fp8` on an unquantized checkpoint: per-channel fp8 weights, quantized as they load, and
    dynamic per-token activations."""
    name = "fp8"

    def __init__(self) -> None:
        self.method = Fp8LinearMethod("channel", "token", online=True)

    def describe(self) -> str:
        return self.method.describe()


class PresetW4A16Config(QuantConfig):
    """`--quantization w4a16` for a preset's random weights (benchmarks): int4, groups of 128, symmetric, made where
    the weights are (an unquantized checkpoint has no int4 tensors to load: quantize it with llm-compressor)."""
    name = "w4a16"

    def __init__(self) -> None:
        from surge.model.quant.wna16 import WNA16LinearMethod
        self.method = WNA16LinearMethod(bits=4, group_size=128, symmetric=True)

    def describe(self) -> str:
        return f"w4a16 (random weights): {self.method.describe()}"


# quant_method -> config class (reading `quantization_config`)
QUANT_METHODS: dict[str, type[QuantConfig]] = {"fp8": Fp8Config}
# --quantization values for unquantized checkpoints
ONLINE_METHODS: dict[str, type[QuantConfig]] = {"fp8": OnlineFp8Config, "w4a16": PresetW4A16Config}


def register_quant_method(name: str, cls: type[QuantConfig]) -> None:
    QUANT_METHODS[name] = cls


def get_quant_config(checkpoint_quant: dict | None, online: str | None) -> QuantConfig | None:
    """The model's quantization: its checkpoint's quantization_config, or `online` (--quantization) for an
    unquantized one; both: they must agree."""
    if checkpoint_quant is not None:
        _import_methods()
        method = checkpoint_quant.get("quant_method")
        if method not in QUANT_METHODS:
            raise ValueError(f"quantization_config.quant_method={method!r} is not supported; supported: "
                             f"{', '.join(sorted(QUANT_METHODS))}")
        if online is not None and online != method:
            raise ValueError(f"quantization={online!r} does not match the checkpoint's quantization_config."
                             f"quant_method={method!r}: leave --quantization out for a quantized checkpoint")
        return QUANT_METHODS[method](checkpoint_quant)
    if online is None:
        return None
    if online not in ONLINE_METHODS:
        raise ValueError(f"quantization={online!r} is not supported for an unquantized checkpoint; supported: "
                         f"{', '.join(sorted(ONLINE_METHODS))}")
    return ONLINE_METHODS[online]()


def _import_methods() -> None:
    """The method files register themselves (kept out of this module's imports: each may pull a kernel)."""
    from surge.model.quant import awq, compressed_tensors, gptq, mxfp4  # noqa: F401


# ---- assigning methods ----

def checkpoint_modules(model: nn.Module, model_dir: str | None) -> dict[str, set[str]]:
    """This model's module name -> the checkpoint module names it loads (from the safetensors headers; a merged
    layer has several). Without a checkpoint (random weights), the names the model's weight mapper would map."""
    from surge.model.loader.safetensors_loader import checkpoint_tensor_names  # it imports the layers, which import us
    names: dict[str, set[str]] = defaultdict(set)
    tensors = checkpoint_tensor_names(model_dir) if model_dir else ()
    if tensors:
        for name in tensors:
            target = model.checkpoint_name_to_param(name)
            if target is not None and "." in target[0]:
                names[target[0].rsplit(".", 1)[0]].add(name.rsplit(".", 1)[0])
        return names
    packed = getattr(model, "weight_mapper", None)
    inverse = defaultdict(list)
    for ckpt, (param, _) in (packed.packed.items() if packed is not None else ()):
        inverse[param].append(ckpt)
    for module_name, _ in model.named_modules():
        head, _, last = module_name.rpartition(".")
        for part in inverse.get(last, [last]):
            names[module_name].add(f"model.{head}.{part}" if head else f"model.{part}")
    return names


def quantize_model(model: nn.Module, quant: QuantConfig | None, device: torch.device,
                   model_dir: str | None) -> None:
    """Give every linear and mixture-of-experts layer built without weights (deferred) its method, which creates
    them on `device`."""
    from surge.model.layers.linear import Linear
    from surge.model.layers.moe import FusedMoE

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear | FusedMoE)
              and not any(k.startswith(("weight", "gate_up_proj", "down_proj")) and not k.endswith("bias")
                          for k in m._parameters)]
    model.quant_skip = quant.skip if quant is not None else ()
    if not layers:
        return
    names = checkpoint_modules(model, model_dir) if quant is not None else {}
    for module_name, layer in layers:
        experts = isinstance(layer, FusedMoE)
        method = UNQUANTIZED_MOE if experts else UNQUANTIZED
        if quant is not None and (experts or layer.quantizable):
            ckpt = sorted(names.get(module_name) or {f"model.{module_name}"})
            methods = {c: quant.moe_method_for(c) if experts else quant.method_for(c) for c in ckpt}
            if len(set(methods.values())) > 1:
                raise ValueError(f"{quant.name} checkpoint: the parts of {module_name} ({', '.join(ckpt)}) are "
                                 "quantized differently; Surge runs them as one GEMM and needs them alike")
            method = methods[ckpt[0]]
        layer.set_method(method, device)
    if quant is not None:
        for module in model.modules():  # producers quantizing a layer's input in their own kernel
            fuse = getattr(module, "fuse_input_quant", None)
            if fuse is not None:
                fuse()
