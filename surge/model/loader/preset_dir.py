"""A vision-language preset as a model directory without weights: its real config.json, its image processor's settings
and a synthetic tokenizer holding the model's special tokens at their real ids and its chat template. `surge serve DIR
--load-format dummy` (and vLLM, with dummy weights) then run the whole multimodal front end with no hub at hand.

Only the Qwen2-VL family (Qwen2.5-VL) has a recipe so far. What is real and what is not:
- config.json: the preset's (the released config.json, see presets.py).
- preprocessor_config.json: Qwen/Qwen2.5-VL-7B-Instruct's file, value for value (`_QWEN2_VL_IMAGE_PROCESSOR`): the
  image processor resizes, normalizes and patchifies exactly as for the released model, so an image takes as many
  tokens as it would there (1,369 for 1024x1024: resized to 1036x1036, 74x74 patches of 14, merged 2x2).
- tokenizer: not Qwen's BPE (151,643 tokens learned from data), but a byte-level vocabulary of the same size whose
  ids 151,643+ are Qwen2's added tokens in Qwen2's order, so every id the config names (image_token_id,
  vision_start_token_id, eos_token_id, ...) is the token it is in the real tokenizer. Common English words (those
  `surge bench serve --endpoint chat` sends) are one token each, as in Qwen's; the rest of the vocabulary is
  filler (" abc" ... " zzzz") so that random weights' output decodes to short words.
- chat template: Qwen2.5-VL's (the default system prompt, one `<|vision_start|><|image_pad|><|vision_end|>` where
  each image part is, `add_vision_id` labels), written out here.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import string
from pathlib import Path

from surge.model.presets import PRESETS, get_preset

# Qwen2's added tokens in id order from 151643 (its tokenizer_config.json's added_tokens_decoder): the first 14 are
# special (skipped when decoding with skip_special_tokens), the tool-call and fill-in-the-middle ones are not.
_QWEN2_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
_QWEN2_PLAIN = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                "<|repo_name|>", "<|file_sep|>")
_QWEN2_BASE_VOCAB = 151643  # Qwen2's BPE tokens; the added tokens start here

# The config's token-id fields and the token each must name (checked, so a preset with other ids fails here).
_QWEN2_VL_CONFIG_TOKENS = {"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>",
                           "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                           "vision_token_id": "<|vision_pad|>", "image_token_id": "<|image_pad|>",
                           "video_token_id": "<|video_pad|>"}

# Qwen/Qwen2.5-VL-7B-Instruct's preprocessor_config.json: min_pixels = 4 x 28 x 28 (at least 2x2 merged tokens),
# max_pixels = 16384 x 28 x 28; 14-pixel patches, 2 frames per temporal patch, 2x2 patches per token (the config's
# vision_config.patch_size / temporal_patch_size / spatial_merge_size, checked); OpenAI CLIP's mean and std.
_QWEN2_VL_IMAGE_PROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}

# Qwen2.5-VL's chat template: a default system prompt when the first message is not one; a string content as is; a
# list of parts with each image (or video) part as its vision span, optionally labelled "Picture N: ".
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Whole-word tokens: the words `surge bench serve --endpoint chat` draws from, and the chat template's own.
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an had "
         "they you were their one all we can her has there been if more when will would who so no system user "
         "assistant You a helpful").split()

_QWEN2_VL_TYPES = ("qwen2_5_vl", "qwen2_vl")
_MARKER = "surge_preset_dir"  # config.json's key naming the preset a directory was written from


def write_preset_dir(preset: str, out_dir: str | Path) -> Path:
    """Write `preset`'s serving directory (no weights) to `out_dir`, replacing one this function wrote before; a
    directory holding anything else is an error. Written beside, then renamed into place."""
    config = get_preset(preset)
    if config.get("model_type") not in _QWEN2_VL_TYPES:
        known = [name for name, c in PRESETS.items() if c.get("model_type") in _QWEN2_VL_TYPES]
        raise ValueError(f"preset={preset!r} (model_type {config.get('model_type')!r}) has no serving-directory recipe;"
                         f" the presets that have one: {', '.join(known)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        found = out_dir / "config.json"
        if not (found.is_file() and _MARKER in json.loads(found.read_text())):
            raise ValueError(f"out_dir={str(out_dir)!r} exists and was not written by `surge preset-dir`; remove it "
                             "or choose another directory")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps({**config, _MARKER: preset}, indent=2))
        (tmp / "preprocessor_config.json").write_text(json.dumps(_image_processor(config), indent=2))
        qwen2_vl_tokenizer(config).save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _image_processor(config: dict) -> dict:
    vision = config["vision_config"]
    pairs = {"patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
             "merge_size": "spatial_merge_size"}
    for ours, theirs in pairs.items():
        if vision.get(theirs) != _QWEN2_VL_IMAGE_PROCESSOR[ours]:
            raise ValueError(f"vision_config.{theirs}={vision.get(theirs)!r} differs from the released image "
                             f"processor's {ours}={_QWEN2_VL_IMAGE_PROCESSOR[ours]}")
    return dict(_QWEN2_VL_IMAGE_PROCESSOR)


def qwen2_vl_tokenizer(config: dict):
    """The synthetic tokenizer (a transformers fast tokenizer with the chat template) for a Qwen2-VL config."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {token: _QWEN2_BASE_VOCAB + i for i, token in enumerate(_QWEN2_SPECIAL + _QWEN2_PLAIN)}
    for field, token in _QWEN2_VL_CONFIG_TOKENS.items():
        if config.get(field) != ids[token]:
            raise ValueError(f"the config's {field}={config.get(field)!r}, but Qwen2's tokenizer has {token} at "
                             f"{ids[token]}")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # every byte, so any text
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
        vocab.setdefault("\u0120" + word, len(vocab))  # "Ġ": the byte-level space before a word
    fillers = ("\u0120" + "".join(letters) for n in (3, 4) for letters in itertools.product(string.ascii_lowercase,
                                                                                              repeat=n))
    for filler in fillers:
        if len(vocab) == _QWEN2_BASE_VOCAB:
            break
        vocab.setdefault(filler, len(vocab))
    # No merges: a pre-token found whole in the vocabulary is one token (ignore_merges), any other falls to bytes.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _QWEN2_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _QWEN2_PLAIN])
    assert all(tok.token_to_id(t) == i for t, i in ids.items()), "added tokens landed off Qwen2's ids"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=config.get("max_position_embeddings", 32768),
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = QWEN2_VL_CHAT_TEMPLATE
    return fast
