"""Tiny random Gemma, Gemma 2 and Gemma 3 (text): Surge's logits equal HF transformers' at every step, through chunked
prefill, prefix hits and preemption, and in prompt logprobs (tests/hf_parity.check_all); config values the models do
not implement are refused by name."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_parity import check_all
from tiny_fam2 import KINDS, make_tiny_model, tiny_config

from surge import LLM


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_gemma_family_matches_hf(tiny):
    check_all(*tiny)


@pytest.mark.parametrize("kind", KINDS)
def test_bidirectional_attention_is_refused(kind, tmp_path):
    config = tiny_config(kind)
    config.use_bidirectional_attention = True
    path = make_tiny_model(kind, tmp_path, config=config)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        LLM(path, block_size=4, kv_cache_memory=1 << 20, max_model_len=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_hf(dtype):
    """(1 + w) in float32, cast once at the end: bitwise HF's GemmaRMSNorm, with and without the residual add."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm

    from surge.model.layers.norm import GemmaRMSNorm
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(16, 576, generator=g) * 3).to(dtype), torch.randn(16, 576, generator=g).to(dtype)
    ours, hf = GemmaRMSNorm(576, 1e-6), HFGemmaRMSNorm(576, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(576, generator=g) - 0.5)
        hf.weight.copy_(ours.weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    with torch.inference_mode():
        assert torch.equal(ours(x), hf(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, hf(x + residual))
