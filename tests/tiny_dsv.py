"""Tiny random DeepSeek V2 and V3 checkpoints (HF transformers' own DeepseekV2/V3ForCausalLM, saved with
save_pretrained) for the family's parity tests.

V2: queries straight from q_proj (q_lora_rank None), group-limited softmax routing (8 experts in 4 groups, the best 2
groups eligible, 3 per token), a shared expert, every layer sparse, default rope. V3: low-rank queries (q_lora_rank),
sigmoid routing with a correction bias (noaux_tc) in 2 groups of which 1 is eligible, renormalized and scaled, the
first layer dense, yarn rope whose mscale and mscale_all_dim differ (so both the rope's attention factor and the
softmax scale's mscale ** 2 matter); V3 with NeoX rope (rope_interleave false) and attention biases. V2-Lite's
shape: plain softmax top-k, no scaling, a dense first layer, yarn with equal mscales. V3 as Moonlight configures
it: q_lora_rank None, one expert group, norm_topk_prob false, two dense layers, default rope. All: v_head_dim
differs from qk_nope + qk_rope."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from tiny_models import VOCAB, randomize, save_tiny

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1,
               max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=False)

KINDS = ("deepseek-v2", "deepseek-v2-lite", "deepseek-v3", "deepseek-v3-neox-bias", "deepseek-v3-moonlight")


def tiny_config(kind: str):
    if kind == "deepseek-v2":
        return DeepseekV2Config(**_COMMON, q_lora_rank=None, num_experts_per_tok=3,
                                topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                routed_scaling_factor=1.5, first_k_dense_replace=0,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "deepseek-v2-lite":  # V2-Lite's shape: plain top-k (no groups), unscaled, yarn with equal mscales
        return DeepseekV2Config(**_COMMON, q_lora_rank=None, num_experts_per_tok=3, topk_method="greedy",
                                routed_scaling_factor=1.0, first_k_dense_replace=1,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})
    if kind == "deepseek-v3-moonlight":  # V3 routing as Moonlight configures it: one group, weights not renormalized;
        config = tiny_config("deepseek-v3")  # queries straight from q_proj; two dense layers; default rope
        config.q_lora_rank, config.norm_topk_prob, config.n_group, config.topk_group = None, False, 1, 1
        config.first_k_dense_replace = 2
        config.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
        return config
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


# ---- DeepSeek-V3 with its multi-token-prediction layer (speculative_config method "deepseek_mtp") ----

def tiny_mtp_config() -> DeepseekV3Config:
    """Tiny V3 with one decoder layer (sparse: first_k_dense_replace 0) and one MTP layer, model.layers.1."""
    config = tiny_config("deepseek-v3")
    config.num_hidden_layers, config.first_k_dense_replace, config.num_nextn_predict_layers = 1, 0, 1
    return config


def make_tiny_mtp_model(path: Path, mtp: str, seed: int = 0, copies: bool = False) -> Path:
    """A tiny V3 checkpoint with an MTP layer (model.layers.1.*: enorm, hnorm, eh_proj, shared_head.norm and a
    decoder block; HF's model ignores them), of two kinds:
    - "random": the layer's own random weights (save_tiny's rules);
    - "copy": the block a copy of the target's one layer, eh_proj [I | 0] (the embedding through, the target's
      hidden state ignored), unit norms, shared_head.norm the final norm, and every embedding row scaled to RMS 1 (so
      enorm leaves it as the target's layer sees it). It then computes the target's own prediction one position on,
      over the context less its first two tokens (position 0's embedding is zeroed), so its drafts are often right.
    copies: also ship the layer's embed_tokens and shared_head.head, equal to the target's (as DeepSeek-V3 does)."""
    config = tiny_mtp_config()
    save_tiny(config, path, seed, extra=_EXTRA)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hidden = config.hidden_size
    torch.manual_seed(seed + 1)
    block = DeepseekV3DecoderLayer(config, layer_idx=1)
    tensors = {}
    with torch.no_grad():
        if mtp == "copy":
            emb = hf.model.embed_tokens.weight
            emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
            hf.save_pretrained(path)
            block.load_state_dict(hf.model.layers[0].state_dict())
            tensors |= {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
                        "eh_proj.weight": torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1),
                        "shared_head.norm.weight": hf.model.norm.weight.clone()}
        elif mtp == "random":
            randomize(block, _EXTRA)
            tensors |= {"enorm.weight": torch.empty(hidden).uniform_(0.5, 1.5),
                        "hnorm.weight": torch.empty(hidden).uniform_(0.5, 1.5),
                        "eh_proj.weight": torch.randn(hidden, 2 * hidden) * (2 * hidden) ** -0.5,
                        "shared_head.norm.weight": torch.empty(hidden).uniform_(0.5, 1.5)}
        else:
            raise ValueError(mtp)
    tensors |= {name: t.detach().clone() for name, t in block.state_dict().items()}
    if copies:
        tensors |= {"embed_tokens.weight": hf.model.embed_tokens.weight.clone(),
                    "shared_head.head.weight": hf.lm_head.weight.clone()}
    save_file({f"model.layers.1.{name}": t.contiguous() for name, t in tensors.items()},
              str(path / "model-mtp.safetensors"))
    return path
