"""AutoAWQ (GEMM) and GPTQ checkpoints packed by tests/tiny_quant.py, converted into the W4A16/W8A16 layout as they
load (surge/model/quant/awq.py, gptq.py): token-identical in float32 to HF transformers running the dequantized
weights (weight-only: the same math, every logit within the parity tolerance), act-order included; two ranks as
one where the split is supported; unsupported configs refused naming the field."""
from __future__ import annotations

import json

import pytest

import hf_parity
from surge import LLM
from tiny_models import make_tiny_model, tiny_config
from tiny_quant import save_awq, save_gptq

CHECKPOINTS = {  # id: builder
    "awq": lambda path: save_awq(tiny_config("llama"), path, ignore=("model.layers.1.mlp",)),
    "gptq-asym": lambda path: save_gptq(tiny_config("llama"), path, sym=False),
    "gptq-act-order": lambda path: save_gptq(tiny_config("llama"), path, desc_act=True),
    "gptq-8bit-act-order-asym": lambda path: save_gptq(tiny_config("llama"), path, bits=8, desc_act=True,
                                                       sym=False),
}


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_awq_gptq_match_hf_on_dequantized_weights(kind, tmp_path):
    hf = CHECKPOINTS[kind](tmp_path)
    hf_parity.check_every_step(kind, tmp_path, hf, budget=7)
    hf_parity.check_prefix_hits_and_preemption(kind, tmp_path, hf)


@pytest.mark.parametrize("kind", ["awq", "gptq-asym"])
def test_awq_gptq_split_over_two_ranks_as_on_one(kind, tmp_path):
    """Column-parallel layers take rows of the converted weights, scales and zeros; row-parallel ones a slice of
    their input's groups."""
    CHECKPOINTS[kind](tmp_path)
    hf_parity.check_two_ranks_decode_as_one(tmp_path, abs_logprob=1e-3)


def test_gptq_act_order_refused_over_two_ranks(tmp_path):
    save_gptq(tiny_config("llama"), tmp_path, desc_act=True)
    with pytest.raises(Exception, match=r"quantization_config\.desc_act=True is not supported"):
        LLM(tmp_path, tensor_parallel_size=2, max_model_len=64, device="cpu", kv_cache_memory=1 << 20)


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}


@pytest.mark.parametrize("quant, message", [
    ({**AWQ, "bits": 3}, "quantization_config.bits=3"),
    ({**AWQ, "version": "gemv"}, "quantization_config.version='gemv'"),
    ({**AWQ, "zero_point": False}, "quantization_config.zero_point=False"),
    ({**GPTQ, "bits": 3}, "quantization_config.bits=3"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "quantization_config.checkpoint_format='marlin'"),
    ({**GPTQ, "lm_head": True}, "quantization_config.lm_head=True"),
    ({**GPTQ, "group_size": 0}, "quantization_config.group_size=0"),
])
def test_unsupported_awq_gptq_refused_by_name(tmp_path, quant, message):
    path = make_tiny_model("llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        LLM(path, max_model_len=64, kv_cache_memory=1 << 20)
