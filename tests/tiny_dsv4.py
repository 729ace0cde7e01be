"""Tiny random DeepSeek V4 checkpoints (HF transformers' own DeepseekV4ForCausalLM, saved with save_pretrained) for
the model's parity tests.

Every layer type (sliding, CSA at rate 4 with an indexer keeping 3 entries, HCA at rate 8 so that a 40-token prompt
spans several of its windows), both MLP types (a hash_moe layer first, sqrtsoftplus-routed MoE with a correction
bias after), two hyper-connection streams, a sliding window of 6 (smaller than the prompts), partial rotary (8 of 32
channels), two output groups. "deepseek-v4-yarn": the compressed layers' rope scaled by yarn, as the released
configs do."""
from __future__ import annotations

from pathlib import Path

from transformers import DeepseekV4Config

from tiny_models import VOCAB, save_tiny

_LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
           "compressed_sparse_attention"]


def tiny_config(kind: str) -> DeepseekV4Config:
    rope = {}
    if kind == "deepseek-v4-yarn":
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
                "beta_slow": 1.0}
    elif kind != "deepseek-v4":
        raise ValueError(kind)
    return DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(_LAYERS),
        num_attention_heads=4, head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=_LAYERS, mlp_layer_types=["hash_moe"] + ["moe"] * (len(_LAYERS) - 1),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, hc_mult=2,
        hc_sinkhorn_iters=3, sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
        index_topk=3, partial_rotary_factor=0.25, max_position_embeddings=512, num_nextn_predict_layers=0,
        swiglu_limit=0.5, rope_parameters=rope or None, bos_token_id=1, eos_token_id=2)


# Randomized where HF's init hides a mistake: zero sinks, position biases and hyper-connection biases, unit scales,
# a zero correction bias, a tid2eid of zeros; projections large enough that attention and the indexer are decisive.
_EXTRA = (("attn.sinks", 1.0), ("position_bias", 0.5), ("_hc.base", 0.5), ("_hc.scale", 0.5),
          ("hc_head.hc_base", 0.5), ("hc_head.hc_scale", 0.5), ("e_score_correction_bias", 0.3),
          ("q_b_proj", 0.3), ("kv_proj", 0.3), ("q_a_proj", 0.3), ("weights_proj", 0.5))


def make_tiny_model(kind: str, path: Path, seed: int = 0) -> Path:
    import torch

    config = tiny_config(kind)
    path = save_tiny(config, path, seed, extra=_EXTRA)
    # The hash layers' frozen token -> experts table: distinct experts per token, spread over the experts.
    from safetensors.torch import load_file, save_file
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith("gate.tid2eid")]:
        vocab, k = tensors[name].shape
        tensors[name] = torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:k] for _ in range(vocab)])
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path
