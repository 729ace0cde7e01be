"""Tiny random Gemma, Gemma 2 and Gemma 3 (text) checkpoints saved as HF directories, for the parity tests.

Built by transformers itself from a config, so the weights and the reference forward pass are HF's own. Soft-caps
are small and the q/k projections large enough that capping changes the logits well past the parity tolerance.
"""
from __future__ import annotations

from pathlib import Path

from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

from tiny_models import VOCAB, save_tiny

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]

KINDS = ["gemma", "gemma2", "gemma3"]


def tiny_config(kind: str):
    if kind == "gemma":
        return GemmaConfig(**_COMMON, hidden_act="gelu_pytorch_tanh", rope_parameters={"rope_type": "default",
                                                                                        "rope_theta": 10000.0})
    if kind == "gemma2":
        return Gemma2Config(**_COMMON, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                            sliding_window=12, layer_types=_LAYER_TYPES, attn_logit_softcapping=4.0,
                            final_logit_softcapping=3.0)
    if kind == "gemma3":  # rope per layer type: local theta 10^4, global 10^6 scaled linearly by 8 (as Gemma 3 4B+)
        return Gemma3TextConfig(**_COMMON, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                                sliding_window=12, layer_types=_LAYER_TYPES, final_logit_softcapping=None,
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                    "rope_theta": 1000000.0}})
    raise ValueError(kind)


def make_tiny_model(kind: str, path: Path, seed: int = 0, config=None) -> Path:
    # q/k scaled up: attention scores of a few units, so the soft-caps bite
    return save_tiny(config or tiny_config(kind), path, seed, extra=(("q_proj.weight", 0.25), ("k_proj.weight", 0.25)))

