"""`surge preset-dir`: a Qwen2.5-VL preset as a model directory without weights. Its tokenizer has Qwen2's added
tokens at the released ids the config names, its chat template renders as Qwen2.5-VL's, its image processor is the
released one (a 1024x1024 image: 1,369 placeholders), and `surge serve DIR --load-format dummy` answers `surge bench
serve`'s image chat requests on the tiny variant."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from transformers import AutoTokenizer

from remote_server import RemoteServer
from surge.bench.serve import _WORDS
from surge.engine.args import EngineArgs
from surge.entrypoints.cli.main import main
from surge.model.loader.preset_dir import write_preset_dir
from surge.model.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration
from surge.model.presets import get_preset

# Qwen2's tokenizer (Qwen/Qwen2.5-VL-7B-Instruct's tokenizer_config.json, added_tokens_decoder): id -> token.
RELEASED_IDS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151646: "<|object_ref_start|>",
                151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
                151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>", 151664: "<|file_sep|>"}
# Its preprocessor_config.json, value for value.
RELEASED_PROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                      "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                      "image_std": [0.26862954, 0.26130258, 0.27577711],
                      "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}
# A 1024x1024 image: each side rounded to a multiple of 28 (patch 14 x merge 2): 1036 = 37 x 28, so 74 x 74 patches
# of 14 pixels, 2x2 of them per token.
GRID, IMAGE_TOKENS = (1, 74, 74), 74 * 74 // 4
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory):
    return write_preset_dir("qwen2.5-vl-7b", tmp_path_factory.mktemp("vl") / "qwen2.5-vl-7b")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_preset_dir("tiny-qwen2.5-vl", tmp_path_factory.mktemp("vl") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(real_dir):
    return AutoTokenizer.from_pretrained(real_dir)


def test_config_is_the_preset_and_the_processor_the_released_one(real_dir):
    config = json.loads((real_dir / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "surge_preset_dir"} == get_preset("qwen2.5-vl-7b")
    assert json.loads((real_dir / "preprocessor_config.json").read_text()) == RELEASED_PROCESSOR
    assert not list(real_dir.glob("*.safetensors"))


def test_tokenizer_has_qwen2_tokens_at_the_released_ids(real_dir, tokenizer):
    config = json.loads((real_dir / "config.json").read_text())
    assert len(tokenizer) == 151665  # Qwen2's 151,643 BPE tokens and 22 added ones
    assert {i: tokenizer.convert_ids_to_tokens(i) for i in RELEASED_IDS} == RELEASED_IDS
    named = {config[f]: RELEASED_IDS[config[f]] for f in ("bos_token_id", "eos_token_id", "image_token_id",
                                                          "vision_start_token_id", "vision_end_token_id",
                                                          "vision_token_id", "video_token_id")}
    assert named == {i: tokenizer.convert_ids_to_tokens(i) for i in named}
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    ids = tokenizer.encode("<|im_start|>hi<tool_call><|image_pad|><|im_end|>")
    assert ids[0] == 151644 and ids[-3:] == [151657, 151655, 151645]  # one token each, no BOS added
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi<tool_call>"  # tool-call tokens are not special


def test_tokenizer_words_and_round_trip(tokenizer):
    # Every word `surge bench serve --endpoint chat` draws is one token, at the start and after a space.
    text = " ".join(_WORDS)
    assert len(tokenizer.encode(text)) == len(_WORDS)
    assert len(tokenizer.encode("You are a helpful assistant.")) == 6
    for text in ["héllo wörld 🙂 xyzzy\n\ttabs  and  spaces", "<|vision_start|>x<|vision_end|>"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([151700]) == ""  # the embedding rows past the vocabulary decode to nothing


def test_chat_template_places_images_as_qwen2_5_vl(tokenizer):
    def render(messages, **kw):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)

    parts = [{"type": "text", "text": "Compare"}, {"type": "image"},
             {"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": " now"}]
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert render([{"role": "user", "content": parts}]) == (
        f"{SYSTEM}<|im_start|>user\nCompare{vision}{vision} now<|im_end|>\n<|im_start|>assistant\n")
    assert render([{"role": "user", "content": parts}], add_vision_id=True) == (
        f"{SYSTEM}<|im_start|>user\nComparePicture 1: {vision}Picture 2: {vision} now<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello"
        "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")


def test_processor_expands_a_1024_image(tiny_dir):
    processor = Qwen2_5_VLForConditionalGeneration.load_processor(str(tiny_dir))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8))
    text = "look: <|vision_start|><|image_pad|><|vision_end|> what?"
    ids, (feature,) = Qwen2_5_VLForConditionalGeneration.process_prompt(processor, text, [image])
    start = ids.index(151652)
    assert ids[start + 1:start + 1 + IMAGE_TOKENS] == [151655] * IMAGE_TOKENS
    assert ids[start + 1 + IMAGE_TOKENS] == 151653 and ids.count(151655) == IMAGE_TOKENS
    assert (feature.offset, feature.length) == (start + 1, IMAGE_TOKENS)
    assert tuple(feature.grid_thw) == GRID
    assert feature.shape == [74 * 74, 3 * 2 * 14 * 14]  # patches x (channels, frames, 14 x 14)


def test_server_answers_bench_serve_image_chat(tiny_dir, tmp_path):
    result = tmp_path / "vlm.json"
    with RemoteServer(tiny_dir, "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "2048",
                      "--kv-cache-memory", str(48 << 20)) as server:
        rc = main(["bench", "serve", "--base-url", server.url, "--endpoint", "chat", "--num-prompts", "2",
                   "--input-len", "8", "--output-len", "4", "--image-size", "1024x1024", "--max-concurrency", "1",
                   "--result-json", str(result), "--chart", str(tmp_path / "c.png")])
    assert rc == 0
    report = json.loads(result.read_text())
    assert (report["completed"], report["failed"], report["output_len_mismatches"]) == (2, 0, 0), report["errors"]
    # The default system prompt (14 tokens: <|im_start|> system \n You are a helpful assistant . <|im_end|> \n
    # <|im_start|> user \n), 8 words, Surge's "\n" before the image part, the image's span, then <|im_end|> \n
    # <|im_start|> assistant \n.
    assert [r["prompt_len"] for r in report["requests"]] == [14 + 8 + 1 + (IMAGE_TOKENS + 2) + 5] * 2


def test_directories_replaced_or_refused(tiny_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    assert write_preset_dir("tiny-qwen2.5-vl", tmp_path / "empty") == tmp_path / "empty"
    assert write_preset_dir("tiny-qwen2.5-vl", tmp_path / "empty") == tmp_path / "empty"  # its own: replaced
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and was not written by `surge preset-dir`"):
        write_preset_dir("tiny-qwen2.5-vl", tmp_path / "other")
    with pytest.raises(ValueError, match="preset='gemma-3-4b' .* the presets that have one: qwen2.5-vl-7b"):
        write_preset_dir("gemma-3-4b", tmp_path / "g")
    assert not list(tmp_path.glob(".*.tmp-*"))
    # Without weights the directory serves only with random ones.
    with pytest.raises(ValueError, match="no \\*.safetensors weight files found \\(load_format 'dummy'"):
        EngineArgs(str(tiny_dir), device="cpu").create_engine_config()
