"""Tiny random vision-language models saved as HF directories with real processors, for fast tests: LLaVA (CLIP
vision tower, two-layer projector, tiny Llama; LlavaProcessor: CLIPImageProcessor + the byte tokenizer with an
`<image>` token), Qwen2.5-VL (its image processor + the byte tokenizer with Qwen's vision tokens) and Gemma 3
(SigLIP, Gemma3Processor)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (CLIPImageProcessor, CLIPVisionConfig, Gemma3Config, Gemma3ForConditionalGeneration,
                          Gemma3Processor, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
                          PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration, SiglipVisionConfig)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from remote_server import CHATML
from tiny_models import _COMMON, VOCAB, byte_tokenizer

IMAGE_TOKEN_ID = VOCAB  # the tokenizer's one added token
IMAGE_SIZE, PATCH = 16, 4  # 16 patches: 16 placeholder tokens per image (CLS dropped)


def tiny_llava_config() -> LlavaConfig:
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(**{**_COMMON, "vocab_size": VOCAB + 1}, rope_theta=10000.0)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       projector_hidden_act="gelu", tie_word_embeddings=False)


def tiny_processor() -> LlavaProcessor:
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tok.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID
    tok.chat_template = CHATML
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE,
                                                                               "width": IMAGE_SIZE})
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH, num_additional_image_tokens=1,
                          vision_feature_select_strategy="default", image_token="<image>")


def make_tiny_llava(path: Path, seed: int = 0) -> Path:
    """Norms uniform in [0.5, 1.5] and biases normal(0, 0.1), so a misplaced one shows."""
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(tiny_llava_config()).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tiny_processor().save_pretrained(path)
    return path


# ---- Qwen2.5-VL: window-attention ViT with 2-D rope, patch merger, Qwen2 decoder with M-RoPE ----

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # ids VOCAB..VOCAB + 3
QWEN_IMAGE_TOKEN_ID = VOCAB + 2
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def tiny_qwen2_5_vl_config() -> Qwen2_5_VLConfig:
    """16-channel heads: M-RoPE sections of 2/3/3 frequencies; 4-pixel patches merged 2x2, windows of 16 pixels
    (2x2 merged tokens), full attention in the second of two blocks. Weights drawn with std 0.1 (not 0.02): the
    greedy tokens then depend on the image and on the positions, so a wrong patch, window or position shows."""
    text = dict(**{**_COMMON, "vocab_size": VOCAB + len(QWEN_TOKENS), "num_hidden_layers": 2},
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                initializer_range=0.1)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=_COMMON["hidden_size"],
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                  initializer_range=0.1)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, vision_start_token_id=VOCAB,
                            vision_end_token_id=VOCAB + 1, image_token_id=QWEN_IMAGE_TOKEN_ID,
                            video_token_id=VOCAB + 3, tie_word_embeddings=False)


def tiny_qwen2_vl_config() -> Qwen2VLConfig:
    """Qwen2-VL: the same decoder; a tower of LayerNorms and fc1/fc2 MLPs, full attention in both blocks."""
    cfg = tiny_qwen2_5_vl_config().to_dict()
    vision = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=_COMMON["hidden_size"], patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.1)
    return Qwen2VLConfig(text_config=cfg["text_config"], vision_config=vision,
                         **{k: cfg[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                                "video_token_id", "tie_word_embeddings")})


def tiny_qwen_image_processor() -> Qwen2VLImageProcessorPil:
    """Images resized to multiples of 8 pixels, between 8x8 and 64x64."""
    return Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 64, "longest_edge": 64 * 64})


def make_tiny_qwen2_5_vl(path: Path, seed: int = 0, qwen2: bool = False) -> Path:
    """The checkpoint, its image processor and the byte tokenizer with Qwen's vision tokens (transformers'
    Qwen2_5_VLProcessor needs torchvision for its video half, so there is none). Norms in [0.5, 1.5], biases
    normal(0, 0.1). qwen2: Qwen2-VL instead."""
    torch.manual_seed(seed)
    model = (Qwen2VLForConditionalGeneration(tiny_qwen2_vl_config()) if qwen2 else
             Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config())).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    assert tok.convert_tokens_to_ids("<|image_pad|>") == QWEN_IMAGE_TOKEN_ID
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    tiny_qwen_image_processor().save_pretrained(path)
    return path


# ---- Gemma 3: SigLIP tower, avg-pool projector, Gemma 3 decoder with bidirectional attention over each image ----

GEMMA3_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]  # ids VOCAB..VOCAB + 2
GEMMA3_IMAGE_TOKEN_ID = VOCAB + 2
GEMMA3_TOKENS_PER_IMAGE = 16  # the tower's 8x8 patches pooled 2x2


def tiny_gemma3_config() -> Gemma3Config:
    """Tiny Gemma 3 text (sliding window 12, shorter than an image's 16 tokens: a query at an image's start sees its
    image's end but only 11 tokens back) and a 2-layer SigLIP over 32x32 images in 4-pixel patches."""
    from tiny_fam2 import tiny_config
    text = tiny_config("gemma3").to_dict()
    text.update(vocab_size=VOCAB + len(GEMMA3_TOKENS), tie_word_embeddings=True)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=32, patch_size=4, vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
                        boi_token_index=VOCAB, eoi_token_index=VOCAB + 1, image_token_index=GEMMA3_IMAGE_TOKEN_ID,
                        tie_word_embeddings=True)


def tiny_gemma3_processor() -> Gemma3Processor:
    """transformers' Gemma3Processor over its PIL image processor (no torchvision) and the byte tokenizer with
    Gemma's image tokens, named as Gemma's tokenizer names them (boi_token, eoi_token, image_token)."""
    base = byte_tokenizer()
    base.add_special_tokens({"additional_special_tokens": GEMMA3_TOKENS})
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, unk_token="<0>", bos_token="<1>",
                                  eos_token="<2>", extra_special_tokens=dict(zip(("boi_token", "eoi_token",
                                                                                  "image_token"), GEMMA3_TOKENS)))
    assert tok.image_token_id == GEMMA3_IMAGE_TOKEN_ID
    tok.chat_template = CHATML
    return Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tok,
                           image_seq_length=GEMMA3_TOKENS_PER_IMAGE)


def make_tiny_gemma3(path: Path, seed: int = 0) -> Path:
    """Norms in [0.5, 1.5]; q/k projections std 0.25 (peaked attention, so a wrong mask shows); the projection
    std 0.05 (HF starts it at zero) and every embedding row random (HF zeroes the pad row, which is the byte
    tokenizer's newline)."""
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(tiny_gemma3_config()).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj.weight" in name or "k_proj.weight" in name:
                p.normal_(0.0, 0.25)
            elif "mm_input_projection" in name:
                p.normal_(0.0, 0.05)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.02)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tiny_gemma3_processor().save_pretrained(path)
    return path
