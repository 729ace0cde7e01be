"""Tiny random Llama / Qwen3 checkpoints for every rope type transformers defines, saved as HF directories.

Each scaling threshold sits at 32 positions (original_max_position_embeddings; max_position_embeddings for dynamic,
whose threshold it is), so prompts plus generated tokens cross it.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from tiny_models import VOCAB, byte_tokenizer

THRESHOLD = 32
HEAD_DIM = 16

# Per rope type, the parameters besides rope_type and rope_theta.
ROPE_PARAMS: dict[str, dict] = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 4.0},
    # factor = max_position_embeddings / original_max_position_embeddings, as HF expects; attention factor 1.277
    "yarn": {"factor": 16.0, "original_max_position_embeddings": THRESHOLD},
    # attention factor from max_position_embeddings / original: sqrt(1 + ln 16 / ln 32)
    "longrope": {"short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 1.5 * i for i in range(HEAD_DIM // 2)],
                 "original_max_position_embeddings": THRESHOLD},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": THRESHOLD},
    "proportional": {"partial_rotary_factor": 0.5, "factor": 2.0},
}

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=512,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def rope_config(family: str, rope_type: str, **rope_overrides):
    """A tiny Llama or Qwen3 config with this rope type."""
    cls, theta = {"llama": (LlamaConfig, 10000.0), "qwen3": (Qwen3Config, 1000000.0)}[family]
    common = dict(_COMMON)
    if rope_type == "dynamic":
        common["max_position_embeddings"] = THRESHOLD
    rope = {"rope_type": rope_type, "rope_theta": theta, **ROPE_PARAMS[rope_type], **rope_overrides}
    return cls(**common, rope_parameters=rope)


def make_tiny_rope_model(family: str, rope_type: str, path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(rope_config(family, rope_type), dtype=torch.float32)
    with torch.no_grad():  # HF initializes norms to 1; randomize them so a wrong norm placement cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
