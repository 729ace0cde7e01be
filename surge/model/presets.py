"""Built-in model presets: real architectures' configs, for random-weight benchmarks with no hub and no disk.

`surge bench ... --preset qwen3-8b` builds the model from these shapes and fills it with random weights.
"""
from __future__ import annotations

import torch

from surge.config import ModelConfig
from surge.model.models.registry import MODEL_REGISTRY

_QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, bos_token_id=151643, eos_token_id=151645, hidden_act="silu", use_sliding_window=False,
    sliding_window=None, max_window_layers=36)

_LLAMA31_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    hidden_act="silu",
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192))

# Qwen/Qwen3-30B-A3B's config.json: 30.5B parameters, 3.3B active per token (8 of 128 experts in each of 48 layers).
_QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, bos_token_id=151643, eos_token_id=151645, hidden_act="silu",
    use_sliding_window=False, sliding_window=None, max_window_layers=48, router_aux_loss_coef=0.001)

# mistralai/Mistral-7B-Instruct-v0.3's config.json (no sliding window since v0.2).
_MISTRAL_7B = dict(
    architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    sliding_window=None, bos_token_id=1, eos_token_id=2, hidden_act="silu")

# google/gemma-3-12b-it's text_config (the language model of Gemma3ForConditionalGeneration): 5 sliding-window
# layers (1024) to each global one, linear rope x8 on the global layers.
_GEMMA3_12B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=3840, intermediate_size=15360,
    num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208,
    max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=1024,
    query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=None,
    final_logit_softcapping=None, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})

# openai/gpt-oss-20b's config.json but its quantization_config (the released experts are MXFP4; these are bf16):
# 24 layers alternating a 128-token window and full attention, 32 experts (4 per token) with biases and the clamped
# SwiGLU, attention sinks, yarn rope x32 over 4096 positions.
_GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
    num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
    num_local_experts=32, num_experts_per_tok=4, swiglu_limit=7.0, sliding_window=128, hidden_act="silu",
    layer_types=["sliding_attention", "full_attention"] * 12, eos_token_id=200002, pad_token_id=199999,
    router_aux_loss_coef=0.9, rope_theta=150000.0,
    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096))

# deepseek-ai/DeepSeek-V2-Lite's config.json: 15.7B parameters, 2.4B active per token (6 of 64 routed experts and 2
# shared in each of 26 sparse layers); MLA with a 512 latent + 64 rope key cached per token and layer (q_lora_rank
# null); yarn x40 over 4096 positions.
_DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
    n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
    routed_scaling_factor=1.0, aux_loss_alpha=0.001, seq_aux=True, ep_size=1, vocab_size=102400,
    max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    attention_dropout=0.0, bos_token_id=100000, eos_token_id=100001, hidden_act="silu", rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
                      original_max_position_embeddings=4096))

# Qwen/Qwen2.5-VL-7B-Instruct's config.json (the released, flat layout: the decoder's fields at the top level, M-RoPE
# as rope_scaling type "mrope"): 8.3B parameters, a 32-block ViT (window attention but in blocks 7/15/23/31) of 0.67B.
_QWEN2_5_VL_7B = dict(
    architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", hidden_size=3584,
    intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
    max_position_embeddings=128000, max_window_layers=28, rms_norm_eps=1e-6, rope_theta=1000000.0,
    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, sliding_window=32768, use_sliding_window=False,
    tie_word_embeddings=False, attention_dropout=0.0, hidden_act="silu", bos_token_id=151643, eos_token_id=151645,
    vision_start_token_id=151652, vision_end_token_id=151653, vision_token_id=151654, image_token_id=151655,
    video_token_id=151656,
    vision_config=dict(depth=32, hidden_act="silu", hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3,
                       out_hidden_size=3584, patch_size=14, spatial_merge_size=2, spatial_patch_size=14,
                       window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
                       temporal_patch_size=2))

# Qwen2.5-VL-7B's layout, token ids and vision geometry (14-pixel patches merged 2x2, temporal patch 2, 112-pixel
# windows) at toy widths: the real processor's image token counts on a model that runs on a CPU in seconds.
_TINY_QWEN2_5_VL = dict(
    _QWEN2_5_VL_7B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, max_window_layers=2,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    vision_config=dict(_QWEN2_5_VL_7B["vision_config"], depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                       out_hidden_size=64, fullatt_block_indexes=[1]))

# google/gemma-3-4b-it's config.json (the text config's other fields are Gemma3TextConfig's defaults: 8 heads, 4 KV
# heads of 256, 5 sliding-window layers (1024) to each global one): 4.3B parameters, a 27-layer SigLIP of 0.42B over
# 896x896 images (64x64 patches, pooled to 256 tokens per image).
_GEMMA3_4B_MM = dict(
    architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", boi_token_index=255999,
    eoi_token_index=256000, eos_token_id=[1, 106], image_token_index=262144, initializer_range=0.02,
    mm_tokens_per_image=256,
    text_config=dict(hidden_size=2560, intermediate_size=10240, model_type="gemma3_text", num_hidden_layers=34,
                     rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024),
    vision_config=dict(hidden_size=1152, image_size=896, intermediate_size=4304, model_type="siglip_vision_model",
                       num_attention_heads=16, num_hidden_layers=27, patch_size=14, vision_use_head=False))

# deepseek-ai/DeepSeek-V4-Flash-Base's shapes (transformers' DeepseekV4Config defaults, which name that checkpoint) cut
# to its first 8 of 43 layers, as many as fit one H200 in bfloat16 (each layer's 256 experts of 2048 are 6.4B
# parameters, 13 GB; 8 layers and the embeddings ~108 GB): HCA x3 then CSA/HCA alternating (transformers' default
# schedule), 3 hash-routed MoE layers then sqrtsoftplus-routed ones, 4 hyper-connection streams, MTP left out.
_DEEPSEEK_V4_FLASH_8L = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=129280, hidden_size=4096,
    moe_intermediate_size=2048, num_hidden_layers=8, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
    q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus",
    norm_topk_prob=True, routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0,
    compress_rope_theta=160000.0, partial_rotary_factor=0.125,
    rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
                     "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.125}},
    layer_types=["heavily_compressed_attention"] * 3 + ["compressed_sparse_attention",
                                                        "heavily_compressed_attention"] * 2 + [
        "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 5,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024,
    index_n_heads=64, index_head_dim=128, index_topk=512, num_nextn_predict_layers=0, hidden_act="silu",
    rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, attention_bias=False,
    mlp_bias=False)

_TINY = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=4096,
    max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, hidden_act="silu")

_TINY_HYBRID = dict(
    _TINY, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False,
    use_sliding_window=True, sliding_window=64,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])

_TINY_MOE = dict(
    _TINY, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", tie_word_embeddings=False,
    moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[3])

PRESETS: dict[str, dict] = {
    "qwen3-8b": _QWEN3_8B,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "llama3.1-8b": _LLAMA31_8B,
    "mistral-7b": _MISTRAL_7B,
    "gemma-3-12b": _GEMMA3_12B,
    "gpt-oss-20b": _GPT_OSS_20B,
    "deepseek-v2-lite": _DEEPSEEK_V2_LITE,
    "qwen2.5-vl-7b": _QWEN2_5_VL_7B,
    "gemma-3-4b": _GEMMA3_4B_MM,
    "deepseek-v4-flash-8l": _DEEPSEEK_V4_FLASH_8L,
    "tiny-llama": _TINY,
    "tiny-qwen3-hybrid": _TINY_HYBRID,
    "tiny-qwen3-moe": _TINY_MOE,
    "tiny-qwen2.5-vl": _TINY_QWEN2_5_VL,
}


def get_preset(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown; available: {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def preset_model_config(name: str, dtype: str | torch.dtype, device: torch.device,
                        max_model_len: int | None = None) -> ModelConfig:
    """The preset's ModelConfig, with random weights (load_format="dummy")."""
    return ModelConfig.from_hf_config(f"preset:{name}", get_preset(name), {}, dtype, device, max_model_len,
                                      load_format="dummy", supported_architectures=tuple(MODEL_REGISTRY))
