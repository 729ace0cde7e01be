"""Quantized tiny checkpoints, written without a hub or a GPU: compressed-tensors' own quantization (round to nearest
from each weight's min/max, as llm-compressor's data-free path) and its compressor for compressed-tensors schemes;
HF's `fp8` block format packed here (block amax / 448, as transformers' FineGrainedFP8 quantizer computes it).

Each returns the reference: HF's model of the same weights, its quantized linear layers holding their dequantized
float32 values."""
from __future__ import annotations

import json
import re
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
    set_dense_weights(hf, dense)
    return hf


_EXPERT = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def set_dense_weights(hf, dense: dict[str, torch.Tensor]) -> None:
    """Checkpoint name -> dequantized weight into HF's model; one expert's gate / up / down into the experts HF
    holds stacked (gate_up_proj [E, 2I, H]: gate rows, then up's; down_proj [E, H, I])."""
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, w in dense.items():
            m = _EXPERT.match(name)
            if m is None:
                params[name].copy_(w)
                continue
            expert = int(m["expert"])
            if m["proj"] == "down":
                params[f"{m['experts']}.down_proj"][expert].copy_(w)
            else:
                rows = w.shape[0]
                start = 0 if m["proj"] == "gate" else rows
                params[f"{m['experts']}.gate_up_proj"][expert, start:start + rows].copy_(w)


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


# ---- AutoAWQ (GEMM) and GPTQ, packed here bit by bit and checked by unpacking ----

SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AutoAWQ word holds column 8c + AWQ_ORDER[i]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _pack(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] unsigned values -> int32 [R, C * bits / 32]: field i of word c holds column c * p + order[i]."""
    p = 32 // bits
    order = order or tuple(range(p))
    v = values.to(torch.int64).reshape(values.shape[0], -1, p)
    words = sum(v[:, :, order[i]] << (bits * i) for i in range(p))
    packed = _to_int32(words).contiguous()
    assert torch.equal(_unpack(packed, bits, order), values.to(torch.int64)), "packing does not round-trip"
    return packed


def _unpack(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    p = 32 // bits
    order = order or tuple(range(p))
    words = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(packed.shape[0], packed.shape[1], p, dtype=torch.int64)
    for i in range(p):
        out[:, :, order[i]] = (words >> (bits * i)) & ((1 << bits) - 1)
    return out.flatten(1)


def _quantize_groups(w: torch.Tensor, bits: int, groups: torch.Tensor, num_groups: int, sym: bool, min_zero: int):
    """Round to nearest per (row, group); groups[k] is input channel k's group. Returns unsigned q [N, K], zeros
    [N, G] (unsigned, 2^(bits-1) when sym), fp16 scales [N, G], and the dequantized float32 weight."""
    maxq = (1 << bits) - 1
    n, k = w.shape
    scales, zeros = torch.empty(n, num_groups), torch.empty(n, num_groups)
    for g in range(num_groups):
        cols = w[:, groups == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            scales[:, g] = torch.maximum(-lo, hi) * 2 / maxq
            zeros[:, g] = (maxq + 1) // 2
        else:
            scales[:, g] = ((hi - lo) / maxq).clamp(min=1e-6)
            zeros[:, g] = (-lo / scales[:, g]).round().clamp(min_zero, maxq)
    scales = scales.clamp(min=1e-6).half()
    s, z = scales.float()[:, groups], zeros[:, groups]
    q = ((w / s).round() + z).clamp(0, maxq)
    return q.long(), zeros.long(), scales, (q - z) * s


def _save_int_checkpoint(config, path: Path, quant: dict, pack, seed: int, ignore: tuple[str, ...] = (),
                         last: str | None = None):
    """pack(name, dense weight [N, K]) -> (checkpoint tensors, dequantized weight) for each quantized linear. last:
    the tensors of that name go into a second shard, read after all others."""
    save_tiny(config, path, seed)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = load_file(str(path / "model.safetensors"))
    dense = {}
    for name in list(tensors):
        if not _is_linear(name) or any(name.startswith(i + ".") for i in ignore):
            continue
        packed, dense[name] = pack(name, tensors.pop(name).float())
        tensors.update({name.removesuffix("weight") + key: t for key, t in packed.items()})
    if last is not None:
        (path / "model.safetensors").unlink()
        later = {name: tensors.pop(name) for name in list(tensors) if name.endswith("." + last)}
        save_file(later, str(path / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
        save_file(tensors, str(path / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    else:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, w in dense.items():
            params[name].copy_(w)
    return hf


def save_awq(config, path: Path, group_size: int = 32, seed: int = 0, ignore: tuple[str, ...] = ()):
    """AutoAWQ GEMM: qweight int32 [K, N / 8] and qzeros [K / group, N / 8] packed along N in AWQ's order, fp16
    scales [K / group, N]; zero points from each group's min / max."""
    def pack(name, w):
        k = w.shape[1]
        q, zeros, scales, dense = _quantize_groups(w, 4, torch.arange(k) // group_size, k // group_size, False, 0)
        return {"qweight": _pack(q.t(), 4, AWQ_ORDER), "qzeros": _pack(zeros.t(), 4, AWQ_ORDER),
                "scales": scales.t().contiguous()}, dense

    quant = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
             "modules_to_not_convert": list(ignore) or None}
    return _save_int_checkpoint(config, path, quant, pack, seed, ignore)


def save_gptq(config, path: Path, bits: int = 4, group_size: int = 32, desc_act: bool = False, sym: bool = True,
              seed: int = 0):
    """GPTQ v1: qweight int32 [K * bits / 32, N] packed along K, qzeros [K / group, N * bits / 32] packed along N
    holding zero - 1, fp16 scales [K / group, N], g_idx [K]. desc_act: each input (the q/k/v projections share one,
    as gate/up do) has its own random quantization order, channel perm[i] in group i // group_size. Asymmetric zeros
    are kept >= 1 (a v1 zero of 0 is stored as -1, which AutoGPTQ's kernels read as 2^bits). With desc_act the
    g_idx tensors come last (a second shard): each qweight arrives before the order it is sorted by."""
    perms = {}

    def pack(name, w):
        n, k = w.shape
        g_idx = torch.arange(k) // group_size
        if desc_act:
            module, proj, _ = name.rsplit(".", 2)
            site = f"{module}.{SHARED_INPUT.get(proj, proj)}"
            perm = perms.setdefault(site, torch.randperm(k, generator=torch.Generator().manual_seed(len(perms))))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // group_size
        q, zeros, scales, dense = _quantize_groups(w, bits, g_idx, k // group_size, sym, 1)
        return {"qweight": _pack(q, bits).t().contiguous(), "qzeros": _pack(zeros.t() - 1, bits),
                "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}, dense

    quant = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
             "checkpoint_format": "gptq"}
    return _save_int_checkpoint(config, path, quant, pack, seed, last="g_idx" if desc_act else None)


# ---- MXFP4 experts (gpt-oss), packed here and checked by unpacking ----

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (blocks uint8 [E, N, K / 32, 16], scales uint8 [E, N, K / 32]): per block of 32 along K the
    exponent e making amax / 2^e <= 6 (e2m1's largest), each value the nearest e2m1 code of w / 2^e (the sign bit 8),
    two codes a byte, the low nibble first."""
    blocks = w.float().unflatten(-1, (-1, 32))
    exponent = torch.log2(blocks.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0).ceil().clamp(-127, 127)
    v = blocks / torch.exp2(exponent).unsqueeze(-1)
    codes = (v.abs().unsqueeze(-1) - E2M1).abs().argmin(-1) + 8 * (v < 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    unpacked = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    assert torch.equal(unpacked.long(), codes), "packing does not round-trip"
    return packed, (exponent + 127).to(torch.uint8)


def save_mxfp4(config, path: Path, seed: int = 0):
    """gpt-oss with MXFP4 experts as the released checkpoints hold them (experts' blocks and scales [E, out, in / 32],
    gate and up interleaved as in the bf16 layout; biases unquantized). The reference: HF's model holding what
    transformers' convert_moe_packed_tensors dequantizes (bf16, then float32)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tiny_fam5 import make_tiny_model

    make_tiny_model("gpt-oss", path, seed)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = load_file(str(path / "model.safetensors"))
    params = dict(hf.named_parameters())
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4_pack(tensors.pop(name).transpose(1, 2))  # stored [E, in, out]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        with torch.no_grad():
            params[name].copy_(convert_moe_packed_tensors(blocks, scales).float())  # returned [E, in, out]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return hf
