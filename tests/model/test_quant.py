"""Quantized checkpoints (surge/model/quant): compressed-tensors schemes written by compressed-tensors itself, HF's
`fp8` block format packed by tests/tiny_quant.py, and online fp8 of an unquantized checkpoint, against HF
transformers running the dequantized weights in float32.

Weight-only schemes (W4A16, W8A16) run exactly HF's math on the dequantized weights: every logit within the parity
tolerance, greedy tokens identical (tests/hf_parity.py). Schemes that quantize activations (fp8) are compared with HF
whose quantized linear layers quantize their inputs the same way (per token, per 1 x 32 group, or with the static
scale: a pre-hook written here). Both sides then compute the same roundings, except where float32 noise (the GEMMs'
summation order) puts an activation on the other side of an fp8 rounding boundary: with e4m3's 3 mantissa bits a
value moves by up to 1/16 of itself, and across these 4 layers that moved logits by up to 2.5e-3 (measured: the
largest over these tests' prompts). So logits within ACT_ATOL, 4x that, and each greedy token within 2 * ACT_ATOL
of HF's largest logit."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_parity
from surge import LLM
from surge.kernels.quant_reference import fp8_fake_quant
from tiny_models import make_tiny_model, tiny_config
from tiny_quant import LINEARS, save_compressed_tensors, save_hf_fp8_block

FP8_MAX = 448.0
ACT_ATOL = 1e-2


def _quantize_input(x: torch.Tensor, mode: str, group: int, scale: float) -> torch.Tensor:
    """The activation quantization of a W8A8 GEMM, undone again, in float32."""
    if mode == "static":
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    g = x.unflatten(-1, (-1, group)) if mode == "group" else x.unsqueeze(-2)
    s = (g.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1 / (FP8_MAX * 512))
    return ((g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).flatten(-2)


def quantizing_inputs(hf, act: str | None, group: int = 32, scale: float = 0.05):
    """HF's model whose quantized linear layers (all but the LM head) quantize their inputs as `act` says."""
    if act is not None:
        for name, module in hf.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                module.register_forward_pre_hook(lambda m, args: (_quantize_input(args[0], act, group, scale),))
    return hf


CT_SCHEMES = {  # id: scheme, builder options, activation quantization of the reference
    "w4a16": ("W4A16", dict(group_size=32), None),
    "w4a16-asym": ("W4A16_ASYM", dict(group_size=32), None),
    "w8a16": ("W8A16", dict(group_size=32), None),
    "w4a16-channel": ("W4A16", dict(channel=True), None),
    "fp8-dynamic": ("FP8_DYNAMIC", {}, "token"),
    "fp8-static": ("FP8", {}, "static"),
    "fp8-block": ("FP8_BLOCK", dict(block=(32, 32)), "group"),
}


@pytest.mark.parametrize("kind", list(CT_SCHEMES))
def test_compressed_tensors_matches_hf_on_dequantized_weights(kind, tmp_path):
    scheme, options, act = CT_SCHEMES[kind]
    hf = quantizing_inputs(save_compressed_tensors(tiny_config("llama"), tmp_path, scheme, **options), act)
    atol = hf_parity.ATOL if act is None else ACT_ATOL
    hf_parity.check_every_step(kind, tmp_path, hf, atol=atol)
    hf_parity.check_every_step(kind, tmp_path, hf, budget=7, atol=atol)


def test_hf_fp8_block_checkpoint_matches_hf(tmp_path):
    hf = quantizing_inputs(save_hf_fp8_block(tiny_config("llama"), tmp_path, block=(32, 32)), "group")
    hf_parity.check_every_step("hf-fp8-block", tmp_path, hf, budget=7, atol=ACT_ATOL)
    hf_parity.check_prefix_hits_and_preemption("hf-fp8-block", tmp_path, hf, atol=ACT_ATOL)


def test_online_fp8_quantizes_per_channel_as_it_loads(tmp_path):
    """`quantization="fp8"` on an unquantized checkpoint: each weight row scaled by its own amax / 448, inputs per
    token; HF runs the same weights quantized here."""
    path = make_tiny_model("llama", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                w = module.weight
                s = w.abs().amax(1, keepdim=True) / FP8_MAX
                w.copy_((w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s)
    hf_parity.check_every_step("online-fp8", path, quantizing_inputs(hf, "token"), budget=7, atol=ACT_ATOL,
                               quantization="fp8")


@pytest.mark.parametrize("kind", ["w4a16-asym", "fp8-static"])
def test_quantized_layers_split_over_two_ranks_as_on_one(kind, tmp_path):
    """Packed int4 weights, group scales and zero points packed along the output, per-tensor fp8 scales kept per
    row: each rank loads its slices (column- and row-parallel), and two ranks decode what one does. (Dynamic
    per-token activation scales differ by design under tensor parallelism: each rank scales its own input slice.)"""
    scheme, options, _ = CT_SCHEMES[kind]
    save_compressed_tensors(tiny_config("llama"), tmp_path, scheme, **options)
    hf_parity.check_two_ranks_decode_as_one(tmp_path, abs_logprob=1e-3)


def _with_quant_config(tmp_path, quant: dict):
    path = make_tiny_model("llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    return path


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method='bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt='e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size=[128]"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "quantization_config.activation_scheme='static'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     "quantization_config.config_groups.group_0.format='int-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                           "actorder": "group"}}}},
     "quantization_config.config_groups.group_0.weights.actorder='group'"),
])
def test_unsupported_quantization_is_refused_by_name(tmp_path, quant, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        LLM(_with_quant_config(tmp_path, quant), max_model_len=64, kv_cache_memory=1 << 20)


def test_quantization_flag_is_checked(tmp_path):
    path = make_tiny_model("llama", tmp_path / "plain")
    with pytest.raises(ValueError, match="quantization='int3' is not supported"):
        LLM(path, quantization="int3", max_model_len=64, kv_cache_memory=1 << 20)
    save_compressed_tensors(tiny_config("llama"), tmp_path / "ct", "W4A16", group_size=32)
    with pytest.raises(ValueError, match="does not match the checkpoint's quantization_config.quant_method="
                                         "'compressed-tensors'"):
        LLM(tmp_path / "ct", quantization="fp8", max_model_len=64, kv_cache_memory=1 << 20)


def test_checkpoint_headers_are_read_once_for_every_build(tmp_path, monkeypatch):
    """An engine builds its model several times (on the meta device for its KV cache layout, then to load); each
    build places its layers' quantization by the checkpoint's tensor names, read from the safetensors headers once,
    and again only after a file changed."""
    from surge.engine.args import EngineArgs
    from surge.model.loader import safetensors_loader
    from surge.model.loader.base import build_model

    save_hf_fp8_block(tiny_config("llama"), tmp_path, block=(32, 32))
    files = sorted(tmp_path.glob("*.safetensors"))
    mc = EngineArgs(model=str(tmp_path), device="cpu", max_model_len=64,
                    kv_cache_memory=1 << 20).create_engine_config().model_config
    opened, real_open = [], safetensors_loader.safe_open

    def counting_open(file, **options):
        opened.append(file)
        return real_open(file, **options)
    monkeypatch.setattr(safetensors_loader, "safe_open", counting_open)
    for _ in range(2):
        assert build_model(mc, torch.device("meta")).layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert len(opened) == len(files)
    stat = files[0].stat()
    os.utime(files[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))
    build_model(mc, torch.device("meta"))
    assert len(opened) == 2 * len(files)


def test_preset_with_random_quantized_weights():
    """Benchmarks' presets: random weights made in the method's own storage (fp8 per channel, normal(0, 0.02)
    before quantization), never an unquantized copy."""
    from surge.engine.args import EngineArgs
    from surge.engine.core import EngineCore

    engine = EngineCore(EngineArgs(preset="tiny-llama", load_format="dummy", device="cpu", max_model_len=64,
                                   kv_cache_memory=1 << 20, quantization="fp8").create_engine_config())
    try:
        layer = engine.executor.runner.model.layers[0].self_attn.qkv_proj
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (layer.out_features, 1)
        assert "weight" in dict(layer.named_parameters()) and len(list(layer.parameters())) == 2
        dense = layer.quant_method.dense_weight(layer).float()
        assert dense.isfinite().all() and 0.015 < dense.std().item() < 0.025
    finally:
        engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm: CUDA")
@pytest.mark.parametrize("weights, activations, block", [("block", "group", (128, 128)), ("channel", "token", None),
                                                         ("tensor", "static", None)])
@pytest.mark.parametrize("rows", [1, 5, 32, 33, 64, 300])
def test_scaled_mm_path_equals_the_dequantized_one(weights, activations, block, rows):
    """The H200's fp8 GEMM (activation kernels + torch._scaled_mm) against the CPU path's math (dequantized weight,
    activations quantized and back) on the same layer, bf16: within bf16 rounding of the output. Up to the weight-only
    kernels' rows (WEIGHT_ONLY_KERNELS: the GEMV, the weight-only GEMM) activations stay unquantized: the reference's too."""
    from surge.model.layers.linear import Linear
    from surge.model.quant.fp8 import WEIGHT_ONLY_KERNELS, Fp8LinearMethod

    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = Linear(512, 384, bias=True)
        finally:
            torch.set_default_dtype(torch.float32)
        method = Fp8LinearMethod(weights, activations, block)
        del layer.weight
        layer.set_method(method, torch.device("cuda"))
        method.init_dummy(layer, torch.Generator(device="cuda").manual_seed(1))
        layer.bias.normal_()
        x = torch.randn(rows, 512, dtype=torch.bfloat16)
    assert method.scaled_mm_serves(x)
    got = layer(x)
    x_sim = fp8_fake_quant(x, "group" if activations == "group" else "token", getattr(layer, "input_scale", None))
    if rows <= WEIGHT_ONLY_KERNELS[-1][0]:
        x_sim = x.float()
    reference = torch.nn.functional.linear(x_sim, method.dense_weight(layer).float(), layer.bias.float())
    torch.testing.assert_close(got.float(), reference, atol=2e-2, rtol=2e-2)


def test_w4a16_preset_path_makes_random_int4_weights_and_refuses_checkpoints(tmp_path):
    from surge.engine.args import EngineArgs
    from surge.engine.core import EngineCore

    engine = EngineCore(EngineArgs(preset="tiny-llama", load_format="dummy", device="cpu", max_model_len=64,
                                   kv_cache_memory=1 << 20, quantization="w4a16").create_engine_config())
    try:
        layer = engine.executor.runner.model.layers[0].mlp.down_proj
        assert layer.weight_packed.dtype == torch.int32 and layer.quant_method.bits == 4
        dense = layer.quant_method.dense_weight(layer).float()
        assert dense.isfinite().all() and 0.01 < dense.std().item() < 0.03
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="quantization='w4a16' makes random int4 weights for a preset"):
        LLM(make_tiny_model("llama", tmp_path), quantization="w4a16", max_model_len=64, kv_cache_memory=1 << 20)


@pytest.mark.parametrize("activations,block", [("token", None), ("static", None), ("group", (128, 128))])
def test_fp8_cuda_path_picks_its_kernel_by_rows(monkeypatch, activations, block):
    """Which kernel the CUDA path launches for a row count, read on the CPU with the kernels replaced by recorders:
    the GEMV up to 4 rows, the weight-only GEMM up to 32, activation quantization and torch._scaled_mm above (group
    scales padded to a multiple of 4 rows, the output cut back). The table as the module docstring states it."""
    import sys
    import types

    from surge.model.layers.linear import Linear
    from surge.model.quant.fp8 import Fp8LinearMethod

    calls: list[tuple[str, int]] = []

    def weight_only(name):
        def kernel(x, weight, weight_scale, bias, block_scales):
            assert block_scales == (block is not None) and weight_scale is layer.weight_scale
            calls.append((name, x.shape[0]))
            return torch.zeros(x.shape[0], weight.shape[0])
        return kernel

    def quantize(name):
        def kernel(x, *args):
            calls.append((name, x.shape[0]))
            return x, torch.ones(x.shape[0], 1)
        return kernel

    def scaled_mm(q, w_t, scale_a, scale_b, out_dtype, bias=None):
        calls.append(("scaled_mm", q.shape[0]))
        return torch.zeros(q.shape[0], w_t.shape[1])

    monkeypatch.setitem(sys.modules, "surge.kernels.gemv", types.SimpleNamespace(fp8_gemv=weight_only("gemv")))
    monkeypatch.setitem(sys.modules, "surge.kernels.fp8_wo_gemm",
                        types.SimpleNamespace(fp8_wo_gemm=weight_only("wo_gemm")))
    fake_quant = types.SimpleNamespace(
        per_token_group_quant_fp8=quantize("quant group"), scaled_fp8_quant_per_tensor=quantize("quant static"),
        scaled_fp8_quant_per_token=quantize("quant token"))
    # `from surge.kernels import fp8_quant` reads the package's attribute once an earlier test imported the module:
    # both places get the fake (alone the test passed, in the suite it saw the real module).
    import surge.kernels
    monkeypatch.setitem(sys.modules, "surge.kernels.fp8_quant", fake_quant)
    monkeypatch.setattr(surge.kernels, "fp8_quant", fake_quant, raising=False)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    method = Fp8LinearMethod("block" if block else "channel", activations, block)
    layer = Linear(256, 128, bias=False)
    del layer.weight
    layer.set_method(method, torch.device("cpu"))
    for rows in (1, 4, 5, 32, 33, 64):
        calls.clear()
        out = method._apply_cuda(layer, torch.randn(1, rows, 256), None)
        assert out.shape == (1, rows, 128)
        padded = rows + (-rows % 4 if activations == "group" else 0)
        wanted = ([("gemv", rows)] if rows <= 4 else [("wo_gemm", rows)] if rows <= 32 else
                  [(f"quant {activations}", padded), ("scaled_mm", padded)])
        assert calls == wanted, rows
