"""OLMo, OLMo 2, OLMo 3, OLMoE, Cohere, GLM, GLM-4 and ERNIE 4.5: tiny random checkpoints match HF transformers
through every parity check (tests/hf_parity.py); config values Surge does not implement are refused by name."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_parity import check_all
from tiny_fam4 import TINY_CONFIGS, make_tiny_model

KINDS = list(TINY_CONFIGS)


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_matches_hf(tiny):
    check_all(*tiny)
