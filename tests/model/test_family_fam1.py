"""Mistral, Mixtral, Qwen2-MoE, SmolLM3, Granite and EXAONE 4 (and Llama with a GELU-tanh MLP): tiny random checkpoints
saved by transformers match HF transformers in float32 through every parity check (tests/hf_parity.py); config values
that are not implemented are refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_parity import check_all, check_every_step
from surge import LLM
from tiny_fam1 import WINDOW, edit_config, make_tiny_model

KINDS = ["mistral", "mistral-nowindow", "mixtral", "qwen2-moe", "smollm3", "granite", "exaone4", "exaone4-full",
         "llama-gelu"]


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# Every layer slides: a request holds a window, not its length, so a smaller cache is what preempts.
ALL_SLIDING = {"mistral", "mixtral"}


def test_family_matches_hf(tiny):
    if tiny[0] in ALL_SLIDING:
        check_all(*tiny, preemption_blocks=20, preemption_max_model_len=64)
    else:
        check_all(*tiny)


def test_mistral_window_without_layer_types_slides_every_layer(tmp_path):
    """A Mistral config.json with sliding_window and no layer_types: every layer slides (full attention before)."""
    path = make_tiny_model("mistral", tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["sliding_window"] == WINDOW and "layer_types" not in config
    llm = LLM(path, block_size=4, kv_cache_memory=1 << 22, max_model_len=256)
    assert [a.sliding_window for a in llm.engine.executor.runner.model.attention_layers()] == [WINDOW] * 4
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_every_step("mistral", path, hf)  # prompts of up to 40 tokens, decoded to 64: past the window


@pytest.mark.parametrize("kind, fields, refused", [
    ("llama-gelu", {"hidden_act": "swiglu_foo"}, "hidden_act='swiglu_foo'"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen2-moe", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("smollm3", {"no_rope_layers": [1, 0]}, r"no_rope_layers=\[1, 0\]"),
])
def test_unsupported_config_value_is_refused_by_name(tmp_path, kind, fields, refused):
    path = make_tiny_model(kind, tmp_path)
    edit_config(path, **fields)
    with pytest.raises(ValueError, match=refused):
        LLM(path, block_size=4, kv_cache_memory=1 << 22, max_model_len=256)
