"""Qwen2.5-VL (window-attention ViT, M-RoPE decoder): a tiny random checkpoint with its real image processor matches
HF transformers' generate token for token in float32: images of several sizes and text in one batch, image spans split
by chunked prefill, prefix-cache hits that end inside an image, one image shown twice (encoded once), preemption; the
M-RoPE positions equal HF's get_rope_index. Qwen2-VL (the same decoder, a tower without windows) too."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

from surge import LLM, SamplingParams
from tiny_vlm import QWEN_IMAGE_TOKEN_ID, QWEN_PLACEHOLDER, make_tiny_qwen2_5_vl, tiny_qwen_image_processor
from vlm_parity import (assert_chat_places_the_image, assert_outputs_match_hf,
                         assert_preempted_image_requests_recompute_to_hf, random_image, with_hf)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
IMG = QWEN_PLACEHOLDER


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return with_hf(make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl")), AutoTokenizer, Qwen2_5_VLForConditionalGeneration)


@pytest.fixture(scope="module")
def llm(tiny):
    # 8 tokens a step over blocks of 4: every image span (6 to 35 tokens) is split over steps.
    return LLM(tiny[0], dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=8,
               max_model_len=160)


def hf_inputs(tiny, text: str, images: list) -> dict:
    """What Qwen2_5_VLProcessor would give (it needs torchvision, so built here): each `<|image_pad|>` expanded to
    the image's merged patch count, the image processor's pixels and grids, the token types."""
    _, tokenizer, _ = tiny
    kw = {}
    if images:
        out = tiny_qwen_image_processor()(images=images, return_tensors="pt")
        parts = text.split("<|image_pad|>")
        counts = [int(g.prod()) // 4 for g in out["image_grid_thw"]]
        text = parts[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, parts[1:]))
        kw = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    ids = torch.tensor([tokenizer.encode(text)])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == QWEN_IMAGE_TOKEN_ID).int(), **kw}


def hf_generate(tiny, text: str, images: list | None = None) -> list[int]:
    inputs = hf_inputs(tiny, text, images or [])
    with torch.no_grad():
        out = tiny[2].generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_mrope_positions_match_hf_get_rope_index(tiny, llm):
    images = [random_image(0), random_image(1, (40, 56)), random_image(2, (64, 16))]
    text = f"a{IMG}bc {IMG}{IMG} tail"
    inputs = hf_inputs(tiny, text, images)
    expected, delta = tiny[2].model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                   inputs["image_grid_thw"])
    ids, features = llm.input_processor.process({"prompt": text, "multi_modal_data": {"image": images}})[1:]
    assert ids == inputs["input_ids"][0].tolist()
    table, d = llm.engine.executor.runner.model.mrope_positions(ids, features)
    np.testing.assert_array_equal(table, expected[:, 0].numpy())
    assert d == int(delta) < 0


def test_images_and_text_match_hf_through_chunked_prefill(tiny, llm):
    """Images of three sizes (edge windows smaller than full ones), one and two per prompt, beside text only."""
    prompts = [{"prompt": f"hi {IMG} what is it", "multi_modal_data": {"image": random_image(0)}},
               {"prompt": f"A{IMG}B and {IMG} two", "multi_modal_data": {"image": [random_image(1, (40, 56)),
                                                                                      random_image(2, (64, 16))]}},
               "just text here",
               {"prompt": f"{IMG}", "multi_modal_data": {"image": [random_image(3, (33, 47))]}}]
    assert_outputs_match_hf(prompts, llm.generate(prompts, GREEDY, use_tqdm=False), partial(hf_generate, tiny))
    assert not llm.engine.executor.runner.encoder_cache.embeds  # every image released once prefilled


def test_prefix_hit_inside_an_image_and_one_image_twice(tiny, llm, monkeypatch):
    """A second prompt sharing the first's text and image up to inside the image's span: its cached blocks end mid
    image, so the rest of the span is encoded again and computed at its own M-RoPE positions. An image shown twice
    in one prompt is encoded once (the encoder cache keeps it until both spans are prefilled)."""
    runner = llm.engine.executor.runner
    encoded = []
    embed_images = runner.model.embed_images
    monkeypatch.setattr(runner.model, "embed_images", lambda fs, d: encoded.extend(fs) or embed_images(fs, d))
    image = random_image(5, (40, 40))  # 25 tokens
    first = {"prompt": f"same start {IMG} ending one", "multi_modal_data": {"image": image}}
    second = {"prompt": f"same start {IMG}", "multi_modal_data": {"image": image}}
    out_first = llm.generate(first, GREEDY, use_tqdm=False)[0]
    out_second = llm.generate(second, GREEDY, use_tqdm=False)[0]
    start = len("same start <|vision_start|>")
    assert start < out_second.num_cached_tokens < start + 25  # the hit ends inside the image
    assert_outputs_match_hf([first, second], [out_first, out_second], partial(hf_generate, tiny))
    twice = {"prompt": f"x{IMG} and again {IMG}.", "multi_modal_data": {"image": [image, image]}}
    encoded.clear()
    assert_outputs_match_hf([twice], llm.generate(twice, GREEDY, use_tqdm=False), partial(hf_generate, tiny))
    assert len(encoded) == 1
    assert not runner.encoder_cache.embeds


def test_chat_places_the_image(tiny, llm):
    assert_chat_places_the_image(llm, IMG, GREEDY, partial(hf_generate, tiny))


def test_preempted_image_requests_recompute_to_hf(tiny):
    """A cache too small for the batch: requests are preempted mid-prefill or mid-decode and recompute (images
    re-encoded, decode positions from the same delta); the KV cache starts as NaN."""
    llm = LLM(tiny[0], dtype="float32", block_size=4, num_gpu_blocks_override=17, max_num_batched_tokens=8,
              max_model_len=64)
    assert_preempted_image_requests_recompute_to_hf(llm, IMG, GREEDY, partial(hf_generate, tiny))


def test_qwen2_5_vl_7b_preset_shapes():
    """The benchmark preset (Qwen/Qwen2.5-VL-7B-Instruct's released, flat config.json) builds, shapes only: 8.3B
    parameters, 0.68B of them the ViT; M-RoPE sections 16/24/24 (from rope_scaling) of the 64 frequencies; the released checkpoint's
    names (`visual.*`, `model.*`, `lm_head.*`) map onto its parameters."""
    from surge.model.loader.base import build_model
    from surge.model.presets import preset_model_config

    mc = preset_model_config("qwen2.5-vl-7b", "bfloat16", torch.device("cpu"), max_model_len=4096)
    model = build_model(mc, torch.device("meta"))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.29
    assert round(sum(p.numel() for p in model.visual.parameters()) / 1e9, 2) == 0.68
    rotary = model.language_model.layers[0].self_attn.rotary
    assert mc.text_config.rope_parameters["mrope_section"] == [16, 24, 24] and rotary.axis.shape == (64,)
    assert model.attention_layers()[0].kv_cache_spec(16, torch.bfloat16).page_size_bytes == 2 * 16 * 4 * 128 * 2
    params = dict(model.named_parameters())
    for name, (param, shard) in {"visual.blocks.0.attn.qkv.weight": ("visual.blocks.0.attn.qkv.weight", None),
                                 "model.layers.3.self_attn.k_proj.bias":
                                     ("language_model.layers.3.self_attn.qkv_proj.bias", "k"),
                                 "model.embed_tokens.weight": ("language_model.embed_tokens.weight", None),
                                 "lm_head.weight": ("language_model.lm_head.weight", None)}.items():
        assert model.checkpoint_name_to_param(name) == (param, shard) and param in params


def test_qwen2_vl_matches_hf(tmp_path):
    path = make_tiny_qwen2_5_vl(tmp_path / "tiny-qwen2-vl", qwen2=True)
    tiny = with_hf(path, AutoTokenizer, Qwen2VLForConditionalGeneration)
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=8,
              max_model_len=160)
    prompts = [{"prompt": f"A{IMG}B and {IMG} two", "multi_modal_data": {"image": [random_image(1, (40, 56)),
                                                                                      random_image(2, (24, 16))]}},
               "just text here"]
    assert_outputs_match_hf(prompts, llm.generate(prompts, GREEDY, use_tqdm=False), partial(hf_generate, tiny))
