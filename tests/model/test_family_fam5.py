"""gpt-oss against HF transformers on tiny random checkpoints (tests/tiny_fam5.py): attention sinks, q/k/v/o biases,
alternating sliding/full layers, the biased top-k-then-softmax router and the experts' biases, interleaved gate/up
and clamped SwiGLU, through every check of tests/hf_parity.py (MXFP4 experts: tests/model/test_quant_moe.py)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_parity
from hf_parity import check_all
from surge.model.loader.base import build_model
from surge.model.presets import preset_model_config
from tiny_fam5 import make_tiny_model

KINDS = ["gpt-oss"]


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_gpt_oss_matches_hf(tiny):
    check_all(*tiny)


def test_gpt_oss_20b_preset_shapes():
    """The benchmark preset (openai/gpt-oss-20b's config, bf16 experts) builds, shapes only: 20.9B parameters, every
    layer's feed-forward block 32 experts with biases, sinks on every attention layer, windows on every other one;
    its rope stays the released yarn (not computed until surge/model/layers/rotary.py has yarn)."""
    mc = preset_model_config("gpt-oss-20b", "bfloat16", torch.device("cpu"), max_model_len=4096)
    assert mc.text_config.rope_parameters["rope_type"] == "yarn"
    with torch.device("meta"):
        model = build_model(mc, torch.device("meta"))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 20.9
    experts = model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (32, 2 * 2880, 2880) and experts.down_proj_bias.shape == (32, 2880)
    windows = [layer.sliding_window for layer in model.attention_layers()]
    assert windows == [128, None] * 12 and all(layer.sinks is not None for layer in model.attention_layers())


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_gpt_oss_tp2_matches_one_rank(tiny, expert_parallel):
    """Two ranks (gloo, worker processes): each rank's sinks, its slice of every expert (the down bias added by one
    rank only) or its whole experts: greedy tokens identical to one rank's, logprobs close."""
    _, path, _ = tiny
    hf_parity.check_two_ranks_decode_as_one(str(path), expert_parallel=expert_parallel)
