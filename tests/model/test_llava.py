"""LLaVA (CLIP tower, projector, Llama): a tiny random checkpoint with its real processor matches HF transformers'
generate token for token in float32, with images and text-only prompts in one batch and image spans split by chunked
prefill; the prefix cache keys blocks by image; bad image input is a clear error."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from surge import LLM, SamplingParams
from tiny_vlm import make_tiny_llava
from vlm_parity import assert_outputs_match_hf, data_url, random_image, with_hf

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return with_hf(make_tiny_llava(tmp_path_factory.mktemp("tiny-llava")), AutoProcessor, LlavaForConditionalGeneration)


@pytest.fixture(scope="module")
def llm(tiny):
    # Budget 8 tokens a step: every image's 16 placeholders span two or three chunks; blocks of 4 tokens.
    return LLM(tiny[0], dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=8,
               max_model_len=128)


def hf_generate(tiny, text: str, images: list | None = None) -> list[int]:
    _, processor, hf = tiny
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_images_and_text_match_hf_through_chunked_prefill(tiny, llm):
    images = [random_image(0), random_image(1, (40, 30))]
    prompts = [{"prompt": "hi <image> what is it", "multi_modal_data": {"image": images[0]}},
               {"prompt": "A<image>B", "multi_modal_data": {"image": [images[1]]}},
               "just text here",
               {"prompt": "two <image><image> images", "multi_modal_data": {"image": images}}]
    assert_outputs_match_hf(prompts, llm.generate(prompts, GREEDY, use_tqdm=False), partial(hf_generate, tiny))
    assert not llm.engine.executor.runner.encoder_cache.embeds  # every image released once prefilled


@pytest.mark.parametrize("text", ["<image><image>", "a<image><image> b", "abc<image>d<image>"])
def test_one_image_twice_in_a_prompt_matches_hf(tiny, llm, text):
    """Both copies share one encoder-cache entry, whether the first copy's span ends in the step that starts the
    second (it must not be released before the second is merged) or before it."""
    image = random_image(7)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": [image, image]}}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_generate(tiny, text, [image, image])
    assert not llm.engine.executor.runner.encoder_cache.embeds


def test_prefix_cache_keys_blocks_by_image(tiny, llm):
    text = "same text <image> then more"
    first, second = Image.new("RGB", (20, 20), (0, 0, 0)), Image.new("RGB", (20, 20), (255, 255, 255))
    out_first = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)[0]
    out_second = llm.generate({"prompt": text, "multi_modal_data": {"image": second}}, GREEDY, use_tqdm=False)[0]
    # Same text, another image: only the 2 blocks before the image are shared; HF's tokens for that image.
    assert out_second.num_cached_tokens == 8
    assert out_second.outputs[0].token_ids == hf_generate(tiny, text, [second]) != out_first.outputs[0].token_ids
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 8 + 16  # the image's blocks too
    assert again.outputs[0].token_ids == out_first.outputs[0].token_ids == hf_generate(tiny, text, [first])


def test_chat_with_data_url_image(tiny, llm):
    image = random_image(3)
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                             {"type": "image_url", "image_url": {"url": data_url(image)}}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = "<|im_start|>user\nlook\n<image><|im_end|>\n<|im_start|>assistant\n"
    assert out.outputs[0].token_ids == hf_generate(tiny, text, [image])


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot decode the image"),
    ("data:image/png;base64,%%%", "not valid base64"),
    ("https://example.com/cat.png", "--allowed-media-domains"),
    ("/etc/passwd", "--allowed-local-media-path"),
])
def test_bad_image_urls_are_clear_errors(llm, url, message):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_bad_multi_modal_data_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="1 image placeholder.*for 2 image"):
        llm.generate({"prompt": "one <image>", "multi_modal_data": {"image": [random_image(0)] * 2}}, GREEDY)
    with pytest.raises(ValueError, match="must be a PIL.Image.Image"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": b"png bytes"}}, GREEDY)
    with pytest.raises(ValueError, match="key 'image'"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"audio": 1}}, GREEDY)


def test_image_on_a_text_only_model_is_a_clear_error(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory=1 << 22, max_model_len=64)
    with pytest.raises(ValueError, match="takes no image input"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": random_image(0)}}, GREEDY)
    with pytest.raises(ValueError, match="takes no image input"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(random_image(0))}}]}],
                 GREEDY)


def test_preempted_image_requests_recompute_to_hf(tiny):
    """A cache too small for the batch: requests are preempted mid-prefill or mid-decode and recompute, images
    re-encoded; the KV cache starts as NaN, so no step may read a slot no request wrote."""
    llm = LLM(tiny[0], dtype="float32", block_size=4, num_gpu_blocks_override=20, max_num_batched_tokens=8,
              max_model_len=64, limit_mm_per_prompt={"image": 1})
    for cache in llm.engine.executor.runner.kv_caches:
        cache.fill_(float("nan"))
    images = [random_image(20 + i, (16 + 8 * i, 16)) for i in range(3)]
    prompts = [{"prompt": f"q{i} <image> what is it", "multi_modal_data": {"image": image}}
               for i, image in enumerate(images)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert not llm.engine.executor.runner.encoder_cache.embeds
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_generate(tiny, prompt["prompt"], [prompt["multi_modal_data"]["image"]])
    with pytest.raises(ValueError, match=r"2 images, over limit_mm_per_prompt=\{'image': 1\}"):
        llm.generate({"prompt": "<image><image>", "multi_modal_data": {"image": images[:2]}}, GREEDY)
