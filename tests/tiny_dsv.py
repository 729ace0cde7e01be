"""Tiny random DeepSeek V2 and V3 checkpoints (HF transformers' own DeepseekV2/V3ForCausalLM, saved with
save_pretrained) for the family's parity tests.

V2: queries straight from q_proj (q_lora_rank None), group-limited softmax routing (8 experts in 4 groups, the best 2
groups eligible, 3 per token), a shared expert, every layer sparse, default rope. V3: low-rank queries (q_lora_rank),
sigmoid routing with a correction bias (noaux_tc) in 2 groups of which 1 is eligible, renormalized and scaled, the
first layer dense, yarn rope whose mscale and mscale_all_dim differ (so both the rope's attention factor and the
softmax scale's mscale ** 2 matter); and V3 with NeoX rope (rope_interleave false) and attention biases. All:
v_head_dim differs from qk_nope + qk_rope."""
from __future__ import annotations

from pathlib import Path

from transformers import DeepseekV2Config, DeepseekV3Config

from tiny_models import VOCAB, save_tiny

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1,
               max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=False)

KINDS = ("deepseek-v2", "deepseek-v3", "deepseek-v3-neox-bias")


def tiny_config(kind: str):
    if kind == "deepseek-v2":
        return DeepseekV2Config(**_COMMON, q_lora_rank=None, num_experts_per_tok=3,
                                topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                routed_scaling_factor=1.5, first_k_dense_replace=0,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "deepseek-v3-neox-bias":  # rope in halves (rope_interleave false), biases on q_a, kv_a and o
        config = tiny_config("deepseek-v3")
        config.rope_interleave, config.attention_bias = False, True
        return config
    if kind == "deepseek-v3":
        return DeepseekV3Config(**_COMMON, q_lora_rank=48, num_experts_per_tok=2, n_group=2, topk_group=1,
                                norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                num_nextn_predict_layers=0,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707})
    raise ValueError(kind)


# A router correction bias large enough to change choices (HF initializes it to zeros); query and latent
# projections large enough that attention is far from uniform (with HF's std 0.02 a 1% error in the softmax scale
# goes unseen).
_EXTRA = (("e_score_correction_bias", 0.3), *((f"self_attn.{name}.", 0.25)
                                              for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                           "kv_b_proj")))


def make_tiny_model(kind: str, path: Path, seed: int = 0) -> Path:
    return save_tiny(tiny_config(kind), path, seed, extra=_EXTRA)
