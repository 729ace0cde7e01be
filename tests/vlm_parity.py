"""Checks shared by the vision-language model tests: Surge's outputs for prompts with images against HF
transformers' generate (each test module brings its model's `hf_generate`), with random images and data URLs."""
from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from surge import LLM, SamplingParams

HfGenerate = Callable[[str, list], list[int]]  # (text with placeholders, its images) -> HF's greedy new tokens


def with_hf(path: Path, processor_class: type, model_class: type) -> tuple[Path, object, torch.nn.Module]:
    """A tiny checkpoint's directory with its processor (or tokenizer) and HF's model in float32, for the tests'
    `tiny` fixtures."""
    return path, processor_class.from_pretrained(path), model_class.from_pretrained(path, dtype=torch.float32).eval()


def random_image(seed: int, size=(20, 24)) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8))


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def assert_outputs_match_hf(prompts: list, outs: list, hf_generate: HfGenerate) -> None:
    """Each output's tokens are HF's for its prompt (a string, or a dict with one image or a list of them)."""
    for prompt, out in zip(prompts, outs):
        text, images = (prompt, []) if isinstance(prompt, str) else (prompt["prompt"],
                                                                      prompt["multi_modal_data"]["image"])
        images = images if isinstance(images, list) else [images]
        assert out.outputs[0].token_ids == hf_generate(text, images), text


def assert_chat_places_the_image(llm: LLM, image_placeholder: str, greedy: SamplingParams,
                                 hf_generate: HfGenerate) -> None:
    """A chat message of text and an image URL answers as HF does for the ChatML prompt with the image after the
    text."""
    image = random_image(7)
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                             {"type": "image_url", "image_url": {"url": data_url(image)}}]}]
    out = llm.chat(messages, greedy, use_tqdm=False)[0]
    text = f"<|im_start|>user\nlook\n{image_placeholder}<|im_end|>\n<|im_start|>assistant\n"
    assert out.outputs[0].token_ids == hf_generate(text, [image])


def assert_preempted_image_requests_recompute_to_hf(llm: LLM, image_placeholder: str, greedy: SamplingParams,
                                                    hf_generate: HfGenerate) -> None:
    """Three prompts with images of three sizes on an `llm` whose KV cache is too small for them together: some
    request is preempted and recomputes, every image is released, and the outputs are HF's. The KV cache starts as
    NaN, so a read of a block nobody wrote shows."""
    for cache in llm.engine.executor.runner.kv_caches:
        cache.fill_(float("nan"))
    prompts = [{"prompt": f"q{i} {image_placeholder} what",
                "multi_modal_data": {"image": random_image(20 + i, (16 + 8 * i, 24))}} for i in range(3)]
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert not llm.engine.executor.runner.encoder_cache.embeds
    assert_outputs_match_hf(prompts, outs, hf_generate)
