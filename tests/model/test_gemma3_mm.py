"""Gemma 3 with images (SigLIP, avg-pool projector, bidirectional attention over each image, sliding layers whose
window is shorter than an image): a tiny random checkpoint with its real Gemma3Processor matches HF transformers'
generate token for token in float32: one and two images beside text, chunk budgets that would split images, a
prefix-cache hit that ends inside an image, preemption; an image too long for one step is a clear error."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import AutoProcessor, Gemma3ForConditionalGeneration

from surge import LLM, SamplingParams
from tiny_vlm import GEMMA3_TOKENS_PER_IMAGE, make_tiny_gemma3
from vlm_parity import (assert_chat_places_the_image, assert_outputs_match_hf,
                         assert_preempted_image_requests_recompute_to_hf, random_image, with_hf)

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
IMG = "<start_of_image>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return with_hf(make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")), AutoProcessor, Gemma3ForConditionalGeneration)


@pytest.fixture(scope="module")
def llm(tiny):
    # 24 tokens a step over blocks of 8: without keeping images whole, chunks would end inside the 16-token images.
    return LLM(tiny[0], dtype="float32", block_size=8, kv_cache_memory=1 << 22, max_num_batched_tokens=24,
               max_model_len=160)


def hf_generate(tiny, text: str, images: list | None = None, bidirectional: bool = True) -> list[int]:
    """HF's generate; bidirectional=False drops token_type_ids, so HF's images attend causally."""
    _, processor, hf = tiny
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    if not bidirectional:
        inputs.pop("token_type_ids")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_images_and_text_match_hf_with_whole_images_per_step(tiny, llm, monkeypatch):
    """One image, two (of other sizes), text only, an image first: every chunk that would end inside an image stops
    before it instead (the runner raises if one did not), and the outputs are HF's, which differ from causal
    attention over the images."""
    scheduler = llm.engine.scheduler
    assert scheduler.config.disable_chunked_mm_input
    cuts = []
    whole_images = scheduler._whole_images
    monkeypatch.setattr(scheduler, "_whole_images",
                        lambda req, start, n: cuts.append((n, m := whole_images(req, start, n))) or m)
    prompts = [{"prompt": f"hi {IMG} what is it", "multi_modal_data": {"image": random_image(0)}},
               {"prompt": f"A{IMG}B and {IMG} two", "multi_modal_data": {"image": [random_image(1, (40, 56)),
                                                                                      random_image(2, (64, 16))]}},
               "just text here",
               {"prompt": f"{IMG} first", "multi_modal_data": {"image": [random_image(3, (33, 47))]}}]
    assert_outputs_match_hf(prompts, llm.generate(prompts, GREEDY, use_tqdm=False), partial(hf_generate, tiny))
    assert any(m < n for n, m in cuts)  # some chunk was cut short of an image
    assert not llm.engine.executor.runner.encoder_cache.embeds  # every image released once prefilled
    first = prompts[0]
    assert hf_generate(tiny, first["prompt"], [first["multi_modal_data"]["image"]], bidirectional=False) != \
        hf_generate(tiny, first["prompt"], [first["multi_modal_data"]["image"]])  # the test can tell


def test_prefix_hit_inside_an_image(tiny, llm):
    """A prompt ending with the first's image: its hit (blocks of 8, capped before the last token) ends five tokens
    before the image's end, so the next step computes those five, which see each other and the cached ones, whose
    KV the first prompt computed with the whole image in view."""
    image = random_image(5, (40, 40))
    first = {"prompt": f"same start{IMG} ending one", "multi_modal_data": {"image": image}}
    second = {"prompt": f"same start{IMG}", "multi_modal_data": {"image": image}}
    out_first = llm.generate(first, GREEDY, use_tqdm=False)[0]
    out_second = llm.generate(second, GREEDY, use_tqdm=False)[0]
    start = len("same start") + 3  # the processor writes "\n\n<start_of_image>" before the image's tokens
    assert out_second.num_cached_tokens == start + GEMMA3_TOKENS_PER_IMAGE - 5
    assert_outputs_match_hf([first, second], [out_first, out_second], partial(hf_generate, tiny))


def test_chat_places_the_image(tiny, llm):
    assert_chat_places_the_image(llm, IMG, GREEDY, partial(hf_generate, tiny))


def test_preempted_image_requests_recompute_to_hf(tiny):
    """A cache too small for the batch: requests are preempted mid-prefill or mid-decode and recompute, each image
    again in one step; the KV cache starts as NaN."""
    llm = LLM(tiny[0], dtype="float32", block_size=4, num_gpu_blocks_override=20, max_num_batched_tokens=20,
              max_model_len=64)
    assert_preempted_image_requests_recompute_to_hf(llm, IMG, GREEDY, partial(hf_generate, tiny))


def test_an_image_longer_than_a_step_is_a_clear_error(tiny):
    llm = LLM(tiny[0], dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_num_batched_tokens=12,
              max_model_len=64)
    with pytest.raises(ValueError, match="image of 16 tokens does not fit in one step of max_num_batched_tokens=12"):
        llm.generate({"prompt": f"x {IMG}", "multi_modal_data": {"image": random_image(0)}}, GREEDY)


def test_gemma_3_4b_preset_shapes():
    """The preset (google/gemma-3-4b-it's config.json) builds, shapes only: 4.30B parameters, 0.42B of them the
    SigLIP tower; every decoder layer (5 sliding of 1024 to each global) sees images both ways; the released
    checkpoint's names (`language_model.model.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`, no
    `lm_head`: tied) map onto its parameters."""
    from surge.model.loader.base import build_model
    from surge.model.presets import preset_model_config

    mc = preset_model_config("gemma-3-4b", "bfloat16", torch.device("cpu"), max_model_len=4096)
    model = build_model(mc, torch.device("meta"))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 4.30
    assert round(sum(p.numel() for p in model.vision_tower.parameters()) / 1e9, 2) == 0.42
    layers = model.attention_layers()
    assert len(layers) == 34 and all(a.params.bidirectional_spans for a in layers)
    assert [a.params.sliding_window for a in layers[:6]] == [1024] * 5 + [None]
    assert model.multi_modal_projector.kernel == 4  # 64 patches a side pooled to 16
    params = dict(model.named_parameters())
    lm, tower, proj = "language_model.", "vision_tower.", "multi_modal_projector.mm_soft_emb_norm.weight"
    for name, param, shard in [(lm + "model.layers.3.self_attn.k_proj.weight",
                                lm + "layers.3.self_attn.qkv_proj.weight", "k"),
                               (tower + "vision_model.encoder.layers.0.mlp.fc1.weight",
                                tower + "encoder.layers.0.mlp.fc1.weight", None),
                               (proj, proj, None),
                               (lm + "model.embed_tokens.weight", lm + "embed_tokens.weight", None)]:
        assert model.checkpoint_name_to_param(name) == (param, shard) and param in params
    assert model.checkpoint_name_to_param("language_model.lm_head.weight") is None  # tied
