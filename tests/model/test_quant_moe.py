"""Quantized experts (FusedMoE's MoE methods, surge/model/quant): a tiny Qwen3-MoE in HF's `fp8` block format
(tests/tiny_quant.py packs it, experts per expert with their weight_scale_inv) and online `--quantization fp8`
(per-channel experts) against HF transformers running the dequantized weights, its quantized layers and experts
quantizing their inputs as the fp8 GEMMs do (tolerance: tests/model/test_quant.py's ACT_ATOL and its reasoning);
a tiny gpt-oss with MXFP4 experts packed here, token-identical to HF on the weights transformers' own
convert_moe_packed_tensors dequantizes."""
from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_parity
from test_quant import ACT_ATOL, FP8_MAX, _quantize_input, quantizing_inputs
from tiny_fam5 import tiny_config as gpt_oss_config
from tiny_models import make_tiny_model, tiny_config
from tiny_quant import LINEARS, save_hf_fp8_block, save_mxfp4


def _experts_forward(mode: str, group: int):
    """HF's experts loop (Qwen3MoeExperts.forward), each expert's input rows and activation quantized and
    dequantized as an fp8 expert GEMM sees them."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            rows = _quantize_input(hidden_states[token], mode, group, 0.0)
            gate, up = torch.nn.functional.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)
            act = _quantize_input(self.act_fn(gate) * up, mode, group, 0.0)
            y = torch.nn.functional.linear(act, self.down_proj[expert]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y)
        return out
    return forward


def quantizing_experts(hf, mode: str, group: int = 32):
    for module in hf.modules():
        if type(module).__name__.endswith("Experts"):
            module.forward = types.MethodType(_experts_forward(mode, group), module)
    return hf


def test_qwen3_moe_fp8_block_experts_match_hf(tmp_path):
    hf = save_hf_fp8_block(tiny_config("qwen3-moe"), tmp_path, block=(32, 32))
    keys = load_file(str(tmp_path / "model.safetensors"))
    assert keys["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert keys["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"].shape == (1, 2)
    hf = quantizing_experts(quantizing_inputs(hf, "group"), "group")
    hf_parity.check_every_step("qwen3-moe-fp8-block", tmp_path, hf, budget=7, atol=ACT_ATOL)
    hf_parity.check_prefix_hits_and_preemption("qwen3-moe-fp8-block", tmp_path, hf, atol=ACT_ATOL)


def test_online_fp8_quantizes_experts_per_channel(tmp_path):
    """`quantization="fp8"` on a bf16 MoE checkpoint: every expert's rows scaled by their own amax / 448 as they
    load, inputs per token; HF runs the same weights quantized here."""
    path = make_tiny_model("qwen3-moe", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in hf.named_parameters():
            if name.rsplit(".", 2)[-2] in LINEARS or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                s = w.abs().amax(-1, keepdim=True) / FP8_MAX
                w.copy_((w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s)
    hf = quantizing_experts(quantizing_inputs(hf, "token"), "token")
    hf_parity.check_every_step("online-fp8-moe", path, hf, budget=7, atol=ACT_ATOL, quantization="fp8")


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    return path, save_mxfp4(gpt_oss_config("gpt-oss"), path)


def test_gpt_oss_mxfp4_experts_match_hf(mxfp4):
    path, hf = mxfp4
    assert load_file(str(path / "model.safetensors"))["model.layers.1.mlp.experts.down_proj_blocks"].shape == \
        (8, 64, 1, 16)
    hf_parity.check_all("gpt-oss-mxfp4", path, hf)


def test_gpt_oss_mxfp4_expert_parallel_as_one_rank(mxfp4):
    """Two ranks holding four whole experts each (the tiny intermediate size, 32, is one MXFP4 block: it cannot be
    split): greedy tokens identical to one rank's."""
    path, _ = mxfp4
    hf_parity.check_two_ranks_decode_as_one(str(path), expert_parallel=True)


def test_moe_preset_with_random_fp8_experts():
    """Benchmarks' presets with `--quantization fp8`: random experts made in fp8 with their per-row scales, never an
    unquantized copy; the router stays unquantized."""
    from surge.engine.args import EngineArgs
    from surge.engine.core import EngineCore

    engine = EngineCore(EngineArgs(preset="tiny-qwen3-moe", load_format="dummy", device="cpu", max_model_len=64,
                                   kv_cache_memory=1 << 20, quantization="fp8").create_engine_config())
    try:
        mlp = next(m for m in engine.executor.runner.model.modules() if hasattr(m, "experts"))
        experts = mlp.experts
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and mlp.gate.weight.dtype != torch.float8_e4m3fn
        assert experts.gate_up_proj_weight_scale.shape == (experts.num_local_experts, 2 * experts.intermediate, 1)
        gate_up, down = experts.quant_method.dense_weights(experts)
        assert gate_up.isfinite().all() and 0.015 < gate_up.std().item() < 0.025
    finally:
        engine.shutdown()
