"""A pooling request with an adapter runs with it, as vLLM applies LoRA to pooling models: the embeddings of
LLM.embed(lora_request=...) and of /v1/embeddings with the adapter's name as `model` equal sentence-transformers'
own encode() of the checkpoint with the adapter merged into its weights; the base model's stay the base's."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from surge import LLM, LoRARequest
from tiny_lora import make_adapter
from tiny_pooling import save_tiny_embedding

TEXTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog. " * 3]
COSINE = 0.9999


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory):
    return save_tiny_embedding(tmp_path_factory.mktemp("emb") / "last", "lasttoken", normalize=True)


@pytest.fixture(scope="module")
def adapter(embed_dir, tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("emb-lora") / "a", embed_dir, rank=8, alpha=16, seed=5, std=0.3)


def _st_encode(path, texts, adapter_dir=None) -> torch.Tensor:
    """sentence-transformers' embeddings, with the adapter merged into the transformer's weights (W += s B A)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    if adapter_dir is not None:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        scaling = config["lora_alpha"] / (math.sqrt(config["r"]) if config.get("use_rslora") else config["r"])
        tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
        modules = dict(model[0].auto_model.named_modules())  # a Qwen3Model: layers.N...
        with torch.no_grad():
            for key, a in tensors.items():
                if ".lora_A." in key:
                    name = key.removeprefix("base_model.model.model.").removesuffix(".lora_A.weight")
                    modules[name].weight += scaling * (tensors[key.replace(".lora_A.", ".lora_B.")] @ a)
    return model.encode(texts, convert_to_tensor=True)


def _assert_close(embeddings, reference: torch.Tensor) -> None:
    for got, want in zip(embeddings, reference):
        assert F.cosine_similarity(torch.tensor(got), want.float(), dim=0).item() >= COSINE


def test_embed_with_an_adapter_matches_the_merged_model(embed_dir, adapter):
    merged, base = _st_encode(embed_dir, TEXTS, adapter), _st_encode(embed_dir, TEXTS)
    assert F.cosine_similarity(merged, base).max().item() < 0.99  # the adapter changes every embedding
    llm = LLM(embed_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=256,
              kv_cache_memory=16 << 20)
    lora = LoRARequest("a", 1, str(adapter))
    _assert_close([o.outputs.embedding for o in llm.embed(TEXTS, lora_request=lora, use_tqdm=False)], merged)
    mixed = llm.embed(TEXTS, lora_request=[lora, None, lora], use_tqdm=False)  # one per prompt, base among them
    _assert_close([o.outputs.embedding for o in mixed], [merged[0], base[1], merged[2]])


def test_embeddings_route_runs_the_named_adapter(embed_dir, adapter):
    from remote_server import RemoteServer

    with RemoteServer(embed_dir, "--served-model-name", "emb", "--max-model-len", "256", "--kv-cache-memory",
                      str(16 << 20), "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                      f"tuned={adapter}") as server:
        client = server.client()
        tuned = client.embeddings.create(model="tuned", input=TEXTS)
        assert tuned.model == "tuned"
        _assert_close([d.embedding for d in tuned.data], _st_encode(embed_dir, TEXTS, adapter))
        base = client.embeddings.create(model="emb", input=TEXTS)
        _assert_close([d.embedding for d in base.data], _st_encode(embed_dir, TEXTS))
