"""Phi-3, Phi-2, StableLM, GPT-NeoX and StarCoder2: tiny random checkpoints match HF transformers through every
parity check (tests/hf_parity.py: every step, chunked prefill, prefix hits + preemption, prompt logprobs)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_parity
from surge import LLM, SamplingParams
from tiny_fam3 import KINDS, make_fam3_model


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = make_fam3_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _preempting_llm_for_sliding_layers(path, **kwargs):
    """With every layer sliding (window 12) a request holds only its window's blocks, so the preemption check's
    40-block cache (the least that admits its max_model_len=128) never runs out; 24 blocks and 64-token requests
    (its prompts and outputs reach 56) do."""
    if "num_gpu_blocks_override" in kwargs:
        kwargs.update(num_gpu_blocks_override=24, max_model_len=64)
    return LLM(path, **kwargs)


def test_family_matches_hf(tiny, monkeypatch):
    name, path, hf = tiny
    if getattr(hf.config, "sliding_window", None) is not None:
        monkeypatch.setattr(hf_parity, "LLM", _preempting_llm_for_sliding_layers)
    hf_parity.check_all(name, path, hf)


@pytest.mark.parametrize("kind", ["phi3", "phi2-qk-layernorm", "stablelm-parallel", "gpt-neox"])
def test_two_ranks_match_hf(kind, tmp_path):
    """Over two tensor-parallel ranks (gloo): fused q/k/v and gate/up tensors (Phi-3), GPT-NeoX's per-head fused
    q/k/v, per-head q/k norms (StableLM) and the LM head's bias (Phi-2) split over the ranks; greedy tokens are HF's
    argmax and their logprobs HF's."""
    path = make_fam3_model(kind, tmp_path / kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, tensor_parallel_size=2, device="cpu", block_size=4, max_model_len=128, kv_cache_memory=1 << 22)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 30)]
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0], -1)[len(prompt) - 1:-1]
        assert tokens == ref.argmax(-1).tolist(), kind
        for row, tok, entry in zip(ref, tokens, out.outputs[0].logprobs):
            assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4), kind


def test_an_activation_not_implemented_is_refused_by_name(tmp_path):
    path = make_fam3_model("starcoder2", tmp_path / "starcoder2", hidden_act="gelu_10")  # HF's clipped GELU
    with pytest.raises(ValueError, match="hidden_act='gelu_10' is not supported"):
        LLM(path, device="cpu", max_model_len=64, kv_cache_memory=1 << 20)
