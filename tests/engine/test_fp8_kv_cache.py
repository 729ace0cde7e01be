"""--kv-cache-dtype fp8 end to end on the CPU: tiny float32 Llama and hybrid Qwen3 (sliding-window and full groups)
with an FP8 KV cache against HF transformers whose attention sees every key and value quantized and dequantized as
the cache stores them, at every step, through chunked prefill, prefix-cache hits and preemption; with the checkpoint's
k_scale / v_scale (in each of the names vLLM accepts) and without them (1.0). The pool holds twice the blocks of a
bf16 cache of the same memory; the layout identity names the dtype; the flag refuses what it does not support."""
from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_parity import ATOL, check_every_step, check_prefix_hits_and_preemption
from surge import LLM
from surge.engine.args import EngineArgs
from surge.kernels.reference import dequantize_fp8, quantize_fp8
from surge.kv_transfer.base import block_layout_key
from tiny_models import make_tiny_model

# Surge's keys and values before quantization equal HF's to float32 rounding (~1e-7 relative), and then the logits
# agree to ~3e-7 (measured), as without FP8. But quantization is discontinuous: an element within that rounding of a
# float8_e4m3fn rounding boundary lands one step (1/16 to 1/8 of its value) apart on the two sides; about one
# element in 10^5 does (K and V of every layer, position and head: ~10^5 elements per check), and such a flip moved
# the logits by 5e-4 (measured, once over these checks). Without the FP8 simulation the logits differ from HF's by
# 0.026 to 0.034 (asserted below to fail this tolerance), so it tells the two apart by more than 10x.
FP8_TOL = 2e-3
# Checkpoint scales, per layer: non-powers of two (their rounding counts), in the three spellings vLLM maps to
# `self_attn.attn.k_scale`: HF / llm-compressor's, compressed-tensors' kv_cache_scheme outputs, ModelOpt's.
SCALES = [(0.021, 0.013), (0.017, 0.029), (0.033, 0.0071), (0.012, 0.019)]
SCALE_NAMES = [("self_attn.k_scale", "self_attn.v_scale"),
               ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
               ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
               ("self_attn.attn.k_scale", "self_attn.attn.v_scale")]


def _fp8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention over the keys and values an FP8 cache would hand back (scales set on the module)."""
    k_scale, v_scale = module.surge_kv_scales
    key = dequantize_fp8(quantize_fp8(key, k_scale), k_scale, key.dtype)
    value = dequantize_fp8(quantize_fp8(value, v_scale), v_scale, value.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("surge_fp8_kv_sdpa", _fp8_kv_sdpa)
AttentionMaskInterface.register("surge_fp8_kv_sdpa", sdpa_mask)  # else HF builds no mask: sliding windows lost


def hf_reference(path, scales: list[tuple[float, float]]):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="surge_fp8_kv_sdpa")
    for layer, (k_scale, v_scale) in zip(hf.model.layers, scales, strict=True):
        layer.self_attn.surge_kv_scales = (torch.tensor(k_scale), torch.tensor(v_scale))
    return hf.eval()


def with_checkpoint_scales(path, out):
    """A copy of the checkpoint with SCALES written under SCALE_NAMES (0-d and [1] tensors, as the tools write)."""
    shutil.copytree(path, out)
    [file] = out.glob("*.safetensors")
    tensors = load_file(file)
    for i, ((k, v), (k_name, v_name)) in enumerate(zip(SCALES, SCALE_NAMES)):
        shape = () if i % 2 == 0 else (1,)
        tensors[f"model.layers.{i}.{k_name}"] = torch.full(shape, k)
        tensors[f"model.layers.{i}.{v_name}"] = torch.full(shape, v)
    save_file(tensors, file, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=["llama", "qwen3-hybrid"])
def tiny(request, tmp_path_factory):
    return request.param, make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("scales", ["absent", "checkpoint"])
def test_fp8_kv_logits_match_hf_quantizing_kv_alike(tiny, scales, tmp_path):
    kind, path = tiny
    if scales == "checkpoint":
        path, layer_scales = with_checkpoint_scales(path, tmp_path / kind), SCALES
    else:
        layer_scales = [(1.0, 1.0)] * len(SCALES)
    llm = LLM(path, kv_cache_dtype="fp8", num_gpu_blocks_override=64, max_model_len=256)
    loaded = [(a.k_scale, a.v_scale) for a in llm.engine.executor.runner.model.attention_layers()]
    assert torch.equal(torch.tensor(loaded), torch.tensor(layer_scales))  # float32, as the checkpoint holds them
    del llm
    hf = hf_reference(path, layer_scales)
    name = f"{kind} fp8 kv ({scales} scales)"
    check_every_step(name, path, hf, budget=7, atol=FP8_TOL, kv_cache_dtype="fp8")  # prefill in 7-token chunks
    check_prefix_hits_and_preemption(name, path, hf, atol=FP8_TOL, kv_cache_dtype="fp8")
    # The simulation is what makes them agree: against plain HF the FP8 cache's logits are far off.
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with pytest.raises(AssertionError, match="not close"):
        check_every_step(name, path, plain, atol=FP8_TOL, kv_cache_dtype="fp8")
    if scales == "checkpoint":  # a cache of the model's dtype ignores the checkpoint's scales (as vLLM's "auto")
        check_every_step(name, path, plain, atol=ATOL)


def test_fp8_pool_holds_twice_the_blocks_of_bf16(tiny):
    kind, path = tiny
    runners = {dtype: LLM(path, dtype="bfloat16", kv_cache_dtype=dtype, kv_cache_memory=1 << 21,
                          max_model_len=256).engine.executor.runner for dtype in ("auto", "fp8")}
    blocks = {dtype: r.kv_cache_config.num_blocks - 1 for dtype, r in runners.items()}  # the null block aside
    assert blocks["fp8"] == 2 * blocks["auto"], blocks
    for dtype, r in runners.items():
        assert all(c.dtype == (torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16) for c in r.kv_caches)
        assert r.kv_cache_config.bytes_per_block * blocks[dtype] <= (1 << 21)  # the budget, both
    # The layout identity every connector keys blocks by names the dtype: fp8 blocks never meet bf16 ones.
    keys = {dtype: block_layout_key(r.config, r.kv_cache_config, 0, 0) for dtype, r in runners.items()}
    assert "|float8_e4m3fn|" in keys["fp8"] and "|bfloat16|" in keys["auto"]


def test_kv_cache_dtype_flag():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = EngineArgs.from_cli_args(p.parse_args(["--kv-cache-dtype", "fp8_e4m3"]))
    assert args.kv_cache_dtype == "fp8_e4m3"
    config = EngineArgs(preset="tiny-llama", device="cpu", kv_cache_dtype="fp8").create_engine_config()
    assert config.cache_config.cache_dtype(torch.bfloat16) == torch.float8_e4m3fn
    assert EngineArgs(preset="tiny-llama", device="cpu").create_engine_config().cache_config.cache_dtype(
        torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2' \(--kv-cache-dtype\) is not supported; use fp8"):
        EngineArgs(preset="tiny-llama", device="cpu", kv_cache_dtype="fp8_e5m2").create_engine_config()
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' \(--kv-cache-dtype\).*auto, fp8, fp8_e4m3"):
        EngineArgs(preset="tiny-llama", device="cpu", kv_cache_dtype="int8").create_engine_config()


def test_a_bad_checkpoint_scale_is_refused_by_name(tmp_path):
    path = with_checkpoint_scales(make_tiny_model("llama", tmp_path / "tiny"), tmp_path / "per-head")
    [file] = path.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.2.self_attn.k_proj.k_scale"] = torch.full((2,), 0.1)  # per head: not per-tensor
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj\.k_scale.*only per-tensor scales"):
        LLM(path, kv_cache_dtype="fp8", num_gpu_blocks_override=64, max_model_len=256)
