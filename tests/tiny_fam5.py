"""Tiny random gpt-oss checkpoints (HF transformers' own GptOssForCausalLM, saved with save_pretrained) for the
family's parity tests.

Default rope here: the released configs use yarn, which surge/model/layers/rotary.py does not compute yet."""
from __future__ import annotations

from pathlib import Path

from transformers import GptOssConfig

from tiny_models import VOCAB, save_tiny

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=False)


def tiny_config(kind: str) -> GptOssConfig:
    if kind == "gpt-oss":
        # 8 experts, 2 per token; a 12-token window on layers 0 and 2. swiglu_limit 0.25 (the real one is 7.0) so
        # that the clamps act on random weights, from above on gate and from both sides on up.
        return GptOssConfig(**_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                            sliding_window=12, swiglu_limit=0.25,
                            layer_types=["sliding_attention", "full_attention"] * 2,
                            rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    raise ValueError(kind)


def make_tiny_model(kind: str, path: Path, seed: int = 0) -> Path:
    # sinks of a few units, and a decisive router (gpt-oss names it mlp.router)
    return save_tiny(tiny_config(kind), path, seed, extra=(("self_attn.sinks", 1.0), (".mlp.router.", 0.3)))

