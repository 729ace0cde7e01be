"""A preset's random weights written as an HF checkpoint: HF transformers loads it with no missing or unexpected
tensor and generates the same greedy tokens as Surge, and Surge loads it back as exactly the preset's in-memory
model."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from surge.bench.common import run_engine
from surge.engine.args import EngineArgs, read_model_config
from surge.engine.core import EngineCore
from surge.model.loader.preset_checkpoint import write_preset_checkpoint
from surge.model.loader.base import load_from_disk
from surge.model.presets import preset_model_config

CPU = torch.device("cpu")


# tied embeddings; untied with q/k norms; experts written one tensor each, as on the hub
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-hybrid", "tiny-qwen3-moe"])
def test_checkpoint_loads_back_as_the_preset(preset, tmp_path):
    path = write_preset_checkpoint(preset, tmp_path / preset, "float32", CPU, seed=3, shard_bytes=1 << 20)
    assert len(list(path.glob("*.safetensors"))) > 1  # sharded, with an index
    assert set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()) == {
        f.name for f in path.glob("*.safetensors")}
    in_memory = load_from_disk(preset_model_config(preset, "float32", CPU), CPU, seed=3)
    loaded = load_from_disk(read_model_config(path, "float32", CPU), CPU)
    ours, theirs = dict(in_memory.named_parameters()), dict(loaded.named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name

    hf, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    prompt = [5, 17, 300, 42, 9, 1000, 77]
    with torch.no_grad():  # greedy from HF's own reading of the checkpoint, against Surge's
        hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    config = EngineArgs(path, device="cpu", max_model_len=64, kv_cache_memory=1 << 22).create_engine_config()
    engine = EngineCore(config)
    assert run_engine(engine, [(prompt, 8)], show_progress=False)["0"] == hf_tokens


def test_existing_directory_is_reused_or_refused(tmp_path):
    path = write_preset_checkpoint("tiny-llama", tmp_path / "c", "float32", CPU)
    mtimes = {f: f.stat().st_mtime_ns for f in path.iterdir()}
    assert write_preset_checkpoint("tiny-llama", path, "float32", CPU) == path
    assert {f: f.stat().st_mtime_ns for f in path.iterdir()} == mtimes  # kept, not rewritten
    with pytest.raises(ValueError, match="does not hold preset 'tiny-llama' \\(bfloat16, seed 0\\)"):
        write_preset_checkpoint("tiny-llama", path, "bfloat16", CPU)
    assert not list(tmp_path.glob(".c.tmp-*"))
