"""Mixture-of-experts pieces against HF transformers: the router's weights and choices, which layers are sparse, and
expert weights loaded alike from per-expert checkpoint tensors (the hub's layout) and from stacked ones (HF
transformers 5 in memory)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from surge.config import ParallelConfig
from surge.engine.args import read_model_config
from surge.model.layers.moe import select_experts
from surge.model.loader.base import build_model
from surge.model.loader.safetensors_loader import iterate_safetensors, load_weights
from surge.model.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer
from tiny_models import make_tiny_model


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_hf(norm_topk_prob):
    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=10, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        x = torch.randn(37, 32)
        _, hf_weights, hf_ids = router(x)
        weights, ids = select_experts(x @ router.weight.T, 3, norm_topk_prob, x.dtype)
    assert ids.tolist() == hf_ids.tolist()
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37))


def _by_expert(weights, ids):
    """Each token's (expert, weight) pairs in expert order: HF's topk(sorted=False) order is not part of the math."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("method,groups,scale", [("greedy", None, 1.0), ("greedy", None, 16.0),
                                                 ("group_limited_greedy", (4, 2), 1.0),
                                                 ("group_limited_greedy", (4, 1), 2.5)])
def test_deepseek_v2_router_matches_hf(method, groups, scale):
    """Softmax scores, optionally only from the topk_group groups of the best expert score, times the scaling."""
    n_group, topk_group = groups or (None, None)
    cfg = DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, topk_method=method,
                           n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale)
    router = DeepseekV2TopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        x = torch.randn(41, 32)
        _, hf_weights, hf_ids = router(x)
        weights, ids = select_experts(x @ router.weight.T, 3, False, x.dtype, num_expert_group=n_group,
                                      topk_group=topk_group, routed_scaling_factor=scale)
    (ids, weights), (hf_ids, hf_weights) = _by_expert(weights, ids), _by_expert(hf_weights, hf_ids)
    assert ids.tolist() == hf_ids.tolist()
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
    if groups:  # every token's experts lie in at most topk_group groups
        assert all(len(set((row // (16 // n_group)).tolist())) <= topk_group for row in ids)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("groups", [(4, 2), (8, 1), (1, 1)])
def test_deepseek_v3_router_matches_hf(norm_topk_prob, groups):
    """Sigmoid scores; the correction bias chooses (groups by their best two, then experts) but does not weight."""
    n_group, topk_group = groups
    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.3)  # large enough to change choices
        x = torch.randn(41, 32)
        _, hf_weights, hf_ids = router(x)
        weights, ids = select_experts(x @ router.weight.T, 4, norm_topk_prob, x.dtype, scoring_func="sigmoid",
                                      num_expert_group=n_group, topk_group=topk_group,
                                      e_score_correction_bias=router.e_score_correction_bias,
                                      routed_scaling_factor=2.5)
        unbiased_ids = select_experts(x @ router.weight.T, 4, norm_topk_prob, x.dtype, scoring_func="sigmoid",
                                      num_expert_group=n_group, topk_group=topk_group)[1]
    (ids, weights), (hf_ids, hf_weights) = _by_expert(weights, ids), _by_expert(hf_weights, hf_ids)
    assert ids.tolist() == hf_ids.tolist()
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
    assert unbiased_ids.sort(-1).values.tolist() != ids.tolist()  # the bias mattered


@pytest.mark.parametrize("step,dense", [(1, []), (2, []), (1, [0, 3]), (3, [2])])
def test_sparse_layers_as_hf_decides(step, dense):
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=step, mlp_only_layers=dense)
    hf = AutoModelForCausalLM.from_config(cfg)
    expected = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    assert [is_sparse_layer(cfg, i) for i in range(6)] == expected
    assert any(expected) and not all(expected) or step == 1 and not dense


def test_per_expert_and_stacked_checkpoints_load_alike(tmp_path):
    path = make_tiny_model("qwen3-moe", tmp_path / "m")
    mc = read_model_config(path, "float32", torch.device("cpu"))
    from_disk = build_model(mc, torch.device("cpu"))
    load_weights(from_disk, iterate_safetensors(path), str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert any(name.endswith("experts.gate_up_proj") for name in hf.state_dict())  # stacked in memory
    from_memory = build_model(mc, torch.device("cpu"))
    load_weights(from_memory, hf.state_dict().items(), "HF model")
    disk = dict(from_disk.named_parameters())
    assert disk["layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    for name, param in from_memory.named_parameters():
        assert torch.equal(param, disk[name]), name
    # Expert 5's gate and up rows, and its down projection, are the hub tensors of expert 5.
    hub = dict(iterate_safetensors(path))
    gate_up = disk["layers.1.mlp.experts.gate_up_proj"][5]
    assert torch.equal(gate_up[:32], hub["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(gate_up[32:], hub["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(disk["layers.1.mlp.experts.down_proj"][5], hub["model.layers.1.mlp.experts.5.down_proj.weight"])


def test_parallel_config_checks_the_experts(tmp_path):
    mc = read_model_config(make_tiny_model("qwen3-moe", tmp_path / "m"), "float32", torch.device("cpu"))
    assert mc.num_experts == 8
    check = Qwen3MoeForCausalLM.check_parallel
    check(mc, ParallelConfig(tensor_parallel_size=2))  # moe_intermediate_size 32 splits in two
    check(mc, ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True))
    six = dataclasses.replace(mc, hf_config={**mc.hf_config, "num_local_experts": 6, "moe_intermediate_size": 30},
                              text_config=None)  # normalized again from the new config.json
    check(six, ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True))
    with pytest.raises(ValueError, match="6 experts do not split evenly"):
        check(six, ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True))
    with pytest.raises(ValueError, match="moe_intermediate_size=30"):
        check(six, ParallelConfig(tensor_parallel_size=4))
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        ParallelConfig(enable_expert_parallel="yes")


def test_uniform_random_routing_spreads_tokens_over_distinct_experts():
    from surge.model.layers.moe import uniform_random_routing

    torch.manual_seed(0)
    weights, ids = uniform_random_routing(torch.zeros(4096, 16), 4, torch.float32)
    assert ids.shape == (4096, 4) and weights.shape == (4096, 4)
    assert all(len(set(row)) == 4 for row in ids.tolist())  # k distinct experts per token
    torch.testing.assert_close(weights, torch.full((4096, 4), 0.25))
    counts = torch.bincount(ids.flatten(), minlength=16).float()
    assert counts.min() > 0.9 * counts.mean()  # every expert reached about equally
