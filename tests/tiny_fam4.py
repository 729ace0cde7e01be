"""Tiny random-weight OLMo, OLMo 2, OLMo 3, OLMoE, Cohere, GLM, GLM-4 and ERNIE 4.5 models saved as HF directories,
built by transformers itself (its modeling classes are the reference)."""
from __future__ import annotations

from pathlib import Path

import transformers


from tiny_models import VOCAB, save_tiny

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
_HYBRID = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# kind -> (config class name, fields over _COMMON)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "olmo": ("OlmoConfig", dict(attention_bias=True, clip_qkv=0.15, rope_theta=10000.0)),
    "olmo2": ("Olmo2Config", dict(rms_norm_eps=1e-6, rope_theta=500000.0)),
    "olmo3": ("Olmo3Config", dict(rms_norm_eps=1e-6, sliding_window=12, layer_types=_HYBRID, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # 8 experts of intermediate_size 32, 3 per token, renormalized; clip_qkv after the projection norms
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                                  clip_qkv=2.0, rms_norm_eps=1e-6, rope_theta=10000.0)),
    "cohere": ("CohereConfig", dict(tie_word_embeddings=True, logit_scale=0.25, rope_theta=10000.0)),
    # per-head q/k LayerNorms and attention biases
    "cohere-qk-norm": ("CohereConfig", dict(tie_word_embeddings=True, logit_scale=0.25, use_qk_norm=True,
                                            attention_bias=True, rope_theta=10000.0)),
    # rope on half of each head (8 of 16 channels), interleaved; q/k/v biases
    "glm": ("GlmConfig", dict(rms_norm_eps=1e-6, attention_bias=True, partial_rotary_factor=0.5)),
    "glm4": ("Glm4Config", dict(rms_norm_eps=1e-6, attention_bias=True, partial_rotary_factor=0.5)),
    # biases on every projection, tied embeddings
    "ernie4_5": ("Ernie4_5Config", dict(rms_norm_eps=1e-6, use_bias=True, tie_word_embeddings=True,
                                        rope_theta=500000.0)),
}


def tiny_config(kind: str):
    class_name, fields = TINY_CONFIGS[kind]
    return getattr(transformers, class_name)(**{**_COMMON, **fields})


def make_tiny_model(kind: str, path: Path, seed: int = 0, **overrides) -> Path:
    config = tiny_config(kind)
    for name, value in overrides.items():
        setattr(config, name, value)
    return save_tiny(config, path, seed)

