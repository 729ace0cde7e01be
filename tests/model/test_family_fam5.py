"""gpt-oss against HF transformers on tiny random checkpoints (tests/tiny_fam5.py): attention sinks, q/k/v/o biases,
alternating sliding/full layers, the biased top-k-then-softmax router and the experts' biases, interleaved gate/up
and clamped SwiGLU, through every check of tests/hf_parity.py; what is not implemented is refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_parity import check_all
from surge.config import ModelConfig
from surge.model.loader.base import build_model
from surge.model.models.registry import MODEL_REGISTRY
from tiny_fam5 import make_tiny_model

KINDS = ["gpt-oss"]


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_gpt_oss_matches_hf(tiny):
    check_all(*tiny)


def test_gpt_oss_refuses_mxfp4(tiny):
    """The released checkpoints' MXFP4 experts: refused by name when the model is built, not a weight-name error."""
    _, path, _ = tiny
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    mc = ModelConfig.from_hf_config(str(path), config, {}, "float32", torch.device("cpu"),
                                    supported_architectures=tuple(MODEL_REGISTRY))
    with pytest.raises(ValueError, match=r"quantization_config.quant_method='mxfp4'"):
        build_model(mc, torch.device("cpu"))
