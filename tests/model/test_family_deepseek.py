"""DeepSeek V2 and V3 against HF transformers on tiny random checkpoints (tests/tiny_dsv.py): multi-head latent
attention over the latent KV cache (decode absorbed, prefill expanded), both routing kinds, shared experts, a dense
first layer, q_lora_rank null and set, yarn with mscale, through every check of tests/hf_parity.py (chunked
prefill, prefix hits, preemption, prompt logprobs); MTP layers skipped at load; what is not implemented is refused by
name."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import hf_parity
from hf_parity import check_all, check_every_step
from surge import LLM, SamplingParams
from surge.config import ModelConfig
from surge.core.kv_cache.spec import MLAAttentionSpec
from surge.model.loader.base import build_model
from surge.model.models.deepseek_v2 import DeepseekMoE
from surge.model.models.llama import MLP
from surge.model.models.registry import MODEL_REGISTRY
from surge.model.presets import preset_model_config
from tiny_dsv import KINDS, make_tiny_model


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_deepseek_matches_hf(tiny):
    check_all(*tiny)


def test_deepseek_triton_mla_matches_hf(tmp_path, monkeypatch):
    """The CUDA path on the CPU (Triton's interpreter), on V3 (low-rank queries, yarn's mscale): every row, prefill
    chunks included, absorbed through the MLA kernel, decode rows split over the KV sequence; HF's logits at every
    step and its greedy tokens, with prefill in 7-token chunks beside decodes. Kept small: the interpreter is slow."""
    import surge.worker.model_runner as model_runner
    from surge.attention.triton_backend import TritonAttentionBackend
    from surge.kernels.mla_attention import MLAPagedAttention

    monkeypatch.setattr(model_runner, "default_backend_name", lambda device: "triton")
    # One SM: the fewest splits that still split (the interpreter runs every program one after another)
    monkeypatch.setattr(TritonAttentionBackend, "mla_kernel", lambda self, device: MLAPagedAttention(device, 1))
    path = make_tiny_model("deepseek-v3", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=7,
              max_model_len=64)
    records = hf_parity.record_logits(llm)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 11)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(records) == 4 * len(prompts)
    hf_parity._check("deepseek-v3-triton", records, prompts, outs, hf, 256)


def test_deepseek_caches_the_latent(tiny):
    """One KV cache group of the MLA spec: kv_lora_rank + qk_rope_head_dim values per token and layer, one plane."""
    _, path, _ = tiny
    runner = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=1 << 20,
                 max_model_len=64).engine.executor.runner
    (group,) = runner.kv_cache_config.groups
    assert group.spec == MLAAttentionSpec(4, 1, 32 + 8, torch.float32, kv_lora_rank=32)
    assert group.layer_ids == (0, 1, 2)
    assert all(c.shape == (1, runner.kv_cache_config.num_blocks, 4, 1, 40) for c in runner.kv_caches)


def _model_config(path, **overrides) -> ModelConfig:
    config = json.loads((path / "config.json").read_text())
    config.update(overrides)
    return ModelConfig.from_hf_config(str(path), config, {}, "float32", torch.device("cpu"),
                                      supported_architectures=tuple(MODEL_REGISTRY))


@pytest.mark.parametrize("kind,field,value,match", [
    ("deepseek-v2", "topk_method", "noaux_tc", r"topk_method='noaux_tc'"),
    ("deepseek-v2", "norm_topk_prob", True, r"norm_topk_prob=True"),
    ("deepseek-v2", "n_group", 3, r"n_group=3"),
    ("deepseek-v3", "scoring_func", "softmax", r"scoring_func='softmax'"),
    ("deepseek-v3", "topk_group", 3, r"topk_group=3"),
    ("deepseek-v3", "hidden_act", "gelu", r"hidden_act='gelu'"),
])
def test_deepseek_refuses_by_name(tmp_path, kind, field, value, match):
    path = make_tiny_model(kind, tmp_path)
    with pytest.raises(ValueError, match=match):
        build_model(_model_config(path, **{field: value}), torch.device("cpu"))


def test_deepseek_refuses_fp8_kv_cache(tmp_path):
    path = make_tiny_model("deepseek-v3", tmp_path)
    with pytest.raises(ValueError, match="kv_cache_dtype=float8_e4m3fn is not supported for MLA"):
        LLM(str(path), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory=1 << 20, max_model_len=64)


def test_deepseek_v3_skips_mtp_layers(tmp_path):
    """A checkpoint with num_nextn_predict_layers = 1 ships its MTP layer as model.layers.<num_hidden_layers>.*
    (DeepSeek-V3's layer 61): skipped at load (HF skips it too), the model otherwise the same."""
    path = make_tiny_model("deepseek-v3", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    mtp = {f"model.layers.3.{name}": torch.randn(shape) for name, shape in [
        ("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("self_attn.kv_b_proj.weight", (112, 32)),
        ("mlp.experts.0.gate_proj.weight", (32, 64)), ("shared_head.head.weight", (256, 64))]}
    save_file(mtp, str(path / "model-mtp.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_every_step("deepseek-v3-mtp", path, hf, max_tokens=4)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_deepseek_tp2_matches_one_rank(tiny, expert_parallel):
    """Two ranks (gloo): heads split (q, kv_b_proj, o_proj), the latent and its cache replicated, each rank's slice
    of every expert or its whole experts: greedy tokens identical to one rank's, logprobs close."""
    _, path, _ = tiny
    hf_parity.check_two_ranks_decode_as_one(str(path), expert_parallel=expert_parallel)


def test_deepseek_v2_lite_preset_shapes():
    """The benchmark preset (deepseek-ai/DeepSeek-V2-Lite's config) builds, shapes only: 15.7B parameters, a dense
    first layer, yarn's mscale ** 2 in the softmax scale, and a KV cache of 576 values a token and layer: 1152 bytes
    in bf16 where a cache of expanded keys (192) and values (128) per head would hold 16 * 320 * 2 = 10240."""
    mc = preset_model_config("deepseek-v2-lite", "bfloat16", torch.device("cpu"), max_model_len=4096)
    with torch.device("meta"):
        model = build_model(mc, torch.device("meta"))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 15.7
    assert isinstance(model.layers[0].mlp, MLP) and all(isinstance(layer.mlp, DeepseekMoE)
                                                        for layer in model.layers[1:])
    mscale = 0.1 * 0.707 * math.log(40) + 1.0
    params = {layer.params for layer in model.attention_layers()}
    assert len(params) == 1 and params.pop().scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    spec = model.attention_layers()[0].kv_cache_spec(16, torch.bfloat16)
    assert spec.page_size_bytes // 16 == 1152


def test_deepseek_v3_config_shapes():
    """deepseek-ai/DeepSeek-V3's config.json (its FP8 quantization_config aside) builds on the meta device: 671B
    parameters without the MTP layer, which the checkpoint ships as layer 61 and the loader skips."""
    config = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
                  intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                  num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
                  kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                  topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                  norm_topk_prob=True, scoring_func="sigmoid", moe_layer_freq=1, num_nextn_predict_layers=1,
                  vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  hidden_act="silu", rope_theta=10000, ep_size=1, aux_loss_alpha=0.001, seq_aux=True,
                  rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=1.0,
                                    mscale_all_dim=1.0, original_max_position_embeddings=4096))
    mc = ModelConfig.from_hf_config("deepseek-v3", config, {}, "bfloat16", torch.device("cpu"), 4096,
                                    load_format="dummy", supported_architectures=tuple(MODEL_REGISTRY))
    with torch.device("meta"):
        model = build_model(mc, torch.device("meta"))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9) == 671
    assert model.checkpoint_name_to_param("model.layers.61.mlp.experts.3.gate_proj.weight") is None
    assert model.checkpoint_name_to_param("model.layers.60.mlp.experts.3.gate_proj.weight") == (
        "layers.60.mlp.experts.gate_up_proj", ("gate", 3))
    assert model.checkpoint_name_to_param("model.layers.3.mlp.gate.e_score_correction_bias") == (
        "layers.3.mlp.gate.e_score_correction_bias", None)
