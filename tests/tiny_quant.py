"""Quantized tiny checkpoints, written without a hub or a GPU: compressed-tensors' own quantization (round to nearest
from each weight's min/max, as llm-compressor's data-free path) and its compressor for compressed-tensors schemes;
HF's `fp8` block format packed here (block amax / 448, as transformers' FineGrainedFP8 quantizer computes it).

Each returns the reference: HF's model of the same weights, its quantized linear layers holding their dequantized
float32 values."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tiny_models import byte_tokenizer, save_tiny

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS


def save_hf_fp8_block(config, path: Path, block: tuple[int, int] = (32, 32), seed: int = 0,
                      ignore: tuple[str, ...] = ()):
    """HF `fp8` with weight_block_size: float8_e4m3fn weights and float32 `weight_scale_inv` per block (the value
    that multiplies the fp8 weight back)."""
    save_tiny(config, path, seed)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = load_file(str(path / "model.safetensors"))
    dense = {}
    for name in list(tensors):
        if not _is_linear(name) or any(f".{i}." in name for i in ignore):
            continue
        w = tensors[name].float()
        n, k = w.shape
        bn, bk = block
        scales = torch.empty(-(-n // bn), -(-k // bk))
        q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        for i in range(scales.shape[0]):
            for j in range(scales.shape[1]):
                tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
                scales[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
                q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scales[i, j]).clamp(-448, 448).to(q.dtype)
        tensors[name] = q
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scales
        dense[name] = q.float() * scales.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, w in dense.items():
            params[name].copy_(w)
    return hf


def save_compressed_tensors(config, path: Path, scheme: str, seed: int = 0, group_size: int | None = None,
                            block: tuple[int, int] | None = None, input_scale: float = 0.05,
                            channel: bool = False):
    """A compressed-tensors checkpoint of `scheme` (a preset name: W4A16, W4A16_ASYM, W8A16, FP8, FP8_DYNAMIC,
    FP8_BLOCK), quantized by compressed-tensors from the tiny model's weights; group_size / block / channel (one
    scale per output row) over the preset's. The reference holds what compressed-tensors' own fake quantization
    makes of each weight."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    save_tiny(config, path, seed)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    qscheme = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None:
        qscheme.weights.group_size = group_size
    if channel:
        qscheme.weights.strategy, qscheme.weights.group_size = "channel", None
    if block is not None:
        qscheme.weights.block_structure = list(block)
        qscheme.input_activations.group_size = block[1]
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": qscheme}, ignore=["lm_head"]))
    dense = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight
            n, k = w.shape
            strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
            if strategy == "group":
                view = w.view(n, k // args.group_size, args.group_size)
                lo, hi = view.amin(-1), view.amax(-1)
            elif strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif strategy == "block":
                bn, bk = args.block_structure
                view = w.view(n // bn, bn, k // bk, bk)
                lo, hi = view.amin(dim=(1, 3)), view.amax(dim=(1, 3))
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape)
            if hasattr(module, "input_scale"):
                module.input_scale.data.fill_(input_scale)
            dense[f"{name}.weight"] = fake_quantize(w, module.weight_scale, getattr(module, "weight_zero_point",
                                                                                     None), args).float()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    byte_tokenizer().save_pretrained(path)
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, w in dense.items():
            params[name].copy_(w)
    return hf
