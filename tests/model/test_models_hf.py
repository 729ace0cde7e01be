"""Tiny random Llama, Qwen3, hybrid Qwen3 and Qwen3-MoE: Surge's logits equal HF transformers' at prefill and at every
decode step, with prompts longer than a block and than the sliding window, batched, with prefill split into chunks,
and through prefix-cache hits and preemption (the checks live in tests/hf_parity.py, shared with every family)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_parity import check_every_step, check_prefix_hits_and_preemption, check_prompt_logprobs
from tiny_models import make_tiny_model

KINDS = ["llama", "llama-tied", "qwen3", "qwen3-hybrid", "qwen3-moe"]


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("budget", [4096, 7])
def test_logits_match_hf_every_step(tiny, budget):
    check_every_step(*tiny, budget=budget)


def test_logits_match_hf_through_prefix_hits_and_preemption(tiny):
    check_prefix_hits_and_preemption(*tiny)


def test_prompt_logprobs_match_hf(tiny):
    check_prompt_logprobs(*tiny)
