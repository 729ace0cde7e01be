"""A tiny random LLaVA (CLIP vision tower, two-layer projector, tiny Llama) saved as an HF directory with a real
processor (LlavaProcessor: CLIPImageProcessor + the byte tokenizer with an `<image>` token), for fast tests."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaProcessor)

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
