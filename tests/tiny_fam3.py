"""Tiny random Phi-3, Phi-2, StableLM, GPT-NeoX and StarCoder2 checkpoints, built and saved by transformers itself,
for the HF parity tests (tests/model/test_family_fam3.py).

Norm weights are random (0.5..1.5) and every bias is random and nonzero (HF initializes them to 0), so a wrong
norm placement or a dropped bias cannot hide."""
from __future__ import annotations

from pathlib import Path

from transformers import (GPTNeoXConfig, Phi3Config, PhiConfig, StableLmConfig,
                          Starcoder2Config)

from tiny_models import VOCAB, save_tiny

_SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def tiny_config(kind: str):
    if kind == "phi3":  # fused qkv_proj / gate_up_proj, partial rotary (Phi-4-mini's 0.75), a sliding window
        return Phi3Config(**_SIZES, num_key_value_heads=2, rms_norm_eps=1e-5, pad_token_id=0, sliding_window=12,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75})
    if kind == "phi2":  # Phi-2 itself: MHA, partial rotary 0.5, gelu_new
        return PhiConfig(**_SIZES, hidden_act="gelu_new", partial_rotary_factor=0.5)
    if kind == "phi2-qk-layernorm":
        return PhiConfig(**{**_SIZES, "tie_word_embeddings": True}, num_key_value_heads=2, hidden_act="gelu_new",
                         partial_rotary_factor=0.5, qk_layernorm=True)
    if kind == "stablelm":  # StableLM-2-1.6B's shape: q/k/v bias, sequential residual, partial rotary 0.25
        return StableLmConfig(**_SIZES, num_key_value_heads=2, use_qkv_bias=True, partial_rotary_factor=0.25)
    if kind == "stablelm-parallel":  # StableLM-2-12B's shape: per-head q/k LayerNorm, parallel residual
        return StableLmConfig(**_SIZES, num_key_value_heads=2, qk_layernorm=True, use_parallel_residual=True,
                              partial_rotary_factor=0.25)
    if kind == "gpt-neox":  # Pythia's shape: parallel residual with two norms, rotary_pct 0.25, exact gelu
        return GPTNeoXConfig(**_SIZES, rotary_pct=0.25, use_parallel_residual=True, hidden_act="gelu")
    if kind == "gpt-neox-sequential":
        return GPTNeoXConfig(**_SIZES, rotary_pct=0.5, use_parallel_residual=False, hidden_act="gelu",
                             attention_bias=False)
    if kind == "starcoder2":  # LayerNorms with bias, plain gelu_pytorch_tanh MLP, a sliding window, tied head
        return Starcoder2Config(**{**_SIZES, "tie_word_embeddings": True}, num_key_value_heads=2, use_bias=True,
                                sliding_window=12, hidden_act="gelu_pytorch_tanh")
    raise ValueError(kind)


KINDS = ["phi3", "phi2", "phi2-qk-layernorm", "stablelm", "stablelm-parallel", "gpt-neox", "gpt-neox-sequential",
         "starcoder2"]


def make_fam3_model(kind: str, path: Path, seed: int = 0, **overrides) -> Path:
    """overrides: config fields set after the kind's (a value Surge should refuse, say)."""
    config = tiny_config(kind)
    for name, value in overrides.items():
        setattr(config, name, value)
    return save_tiny(config, path, seed)

