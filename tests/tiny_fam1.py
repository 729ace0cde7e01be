"""Tiny random-weight HF models of the families Mistral, Mixtral, Qwen2-MoE, SmolLM3, Granite and EXAONE 4 (and Llama
with a GELU-tanh MLP), saved as HF directories by transformers itself, for the parity tests."""
from __future__ import annotations

import json
from pathlib import Path

from transformers import (Exaone4Config, GraniteConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Qwen2MoeConfig, SmolLM3Config)

from tiny_models import VOCAB, save_tiny

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
WINDOW = 12  # prompts reach 40+ tokens


def tiny_config(kind: str):
    if kind == "mistral":  # a window on every layer, from sliding_window alone (config.json has no layer_types)
        return MistralConfig(**_COMMON, sliding_window=WINDOW)
    if kind == "mistral-nowindow":
        return MistralConfig(**_COMMON, sliding_window=None)
    if kind == "mixtral":  # 8 experts, 2 per token (always renormalized), windowed attention
        return MixtralConfig(**{**_COMMON, "intermediate_size": 32}, sliding_window=WINDOW, num_local_experts=8,
                             num_experts_per_tok=2)
    if kind == "qwen2-moe":  # 8 experts, 3 per token, not renormalized, a shared expert; layer 2 dense
        return Qwen2MoeConfig(**_COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                              num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=1,
                              mlp_only_layers=[2])
    if kind == "smollm3":  # layers 1 and 3 without rope; tied embeddings as the real checkpoints
        return SmolLM3Config(**{**_COMMON, "tie_word_embeddings": True}, no_rope_layer_interval=2, pad_token_id=None)
    if kind == "granite":
        return GraniteConfig(**_COMMON, embedding_multiplier=12.0, attention_multiplier=0.5,
                             residual_multiplier=0.22, logits_scaling=8.0)
    if kind == "exaone4":  # layers 0-2 sliding with rope, layer 3 full without rope
        return Exaone4Config(**_COMMON, sliding_window=WINDOW, sliding_window_pattern=4)
    if kind == "exaone4-full":  # no window: every layer full, with rope (EXAONE-4.0-1.2B's layout)
        return Exaone4Config(**_COMMON, sliding_window=None, layer_types=["full_attention"] * 4)
    if kind == "llama-gelu":
        return LlamaConfig(**_COMMON, hidden_act="gelu_pytorch_tanh")
    raise ValueError(kind)


def make_tiny_model(kind: str, path: Path, seed: int = 0) -> Path:
    return save_tiny(tiny_config(kind), path, seed)


def edit_config(path: Path, **fields) -> None:
    """Set fields of a saved config.json (a value of None removes the field)."""
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config, indent=2))
