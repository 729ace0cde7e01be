"""LoRA over HTTP with the official client: adapters from --lora-modules (name=path and JSON) served by name,
listed by /v1/models with their parent, greedy completions equal to HF with the adapter merged, adapters loaded and
unloaded at runtime (only when SURGE_ALLOW_RUNTIME_LORA_UPDATING is set), errors in OpenAI's shape."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from remote_server import RemoteServer
from tiny_lora import ATTENTION, hf_greedy, make_adapter, merged_hf_model

PROMPT = "The quick brown fox"
N = 10


@contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-adapters")
    return {"r8": make_adapter(root / "r8", tiny_model_dir, rank=8, alpha=16, seed=1),
            "attn": make_adapter(root / "attn", tiny_model_dir, rank=4, alpha=8, targets=ATTENTION, seed=2,
                                 use_rslora=True),
            "late": make_adapter(root / "late", tiny_model_dir, rank=16, alpha=4, seed=3),
            "too-big": make_adapter(root / "big", tiny_model_dir, rank=32, alpha=4, seed=4)}


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters):
    modules = [f"r8={adapters['r8']}", json.dumps({"name": "attn", "path": str(adapters["attn"])})]
    with _env(SURGE_ALLOW_RUNTIME_LORA_UPDATING="1"):
        srv = RemoteServer(tiny_model_dir, "--served-model-name", "tiny", "--max-model-len", "256",
                           "--kv-cache-memory", str(16 << 20), "--enable-lora", "--max-loras", "2",
                           "--max-lora-rank", "16", "--lora-modules", *modules)
    with srv:
        yield srv


def _expected(tiny_model_dir, adapter) -> str:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = hf_greedy(merged_hf_model(tiny_model_dir, adapter), tokenizer.encode(PROMPT), N)
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_models_lists_adapters_with_parent(server, adapters):
    cards = {m.id: m for m in server.client().models.list().data}
    assert set(cards) == {"tiny", "r8", "attn"}
    assert cards["r8"].parent == "tiny" and cards["r8"].root == str(adapters["r8"])
    assert cards["tiny"].parent is None


def test_completions_run_each_adapter(server, tiny_model_dir, adapters):
    client = server.client()
    for model, adapter in [("r8", adapters["r8"]), ("attn", adapters["attn"]), ("tiny", None)]:
        assert _complete(client, model) == _expected(tiny_model_dir, adapter), model
    reply = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.model == "attn"


def test_lora_requests_info_metric(server):
    _complete(server.client(), "r8")
    text = httpx.get(f"{server.url}/metrics").text
    assert 'surge:lora_requests_info{max_lora="2",' in text
    assert 'running_lora_adapters="r8"' in text or 'waiting_lora_adapters="r8"' in text


def test_unknown_adapter_is_404(server):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(server.client(), "nope")
    assert e.value.body["code"] == "model_not_found"


def test_load_and_unload_at_runtime(server, tiny_model_dir, adapters):
    url, client = server.url, server.client()
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])})
    assert r.status_code == 200, r.text
    assert "late" in {m.id for m in client.models.list().data}
    assert _complete(client, "late") == _expected(tiny_model_dir, adapters["late"])
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    big = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapters["too-big"])})
    assert big.status_code == 400 and "max_lora_rank=16" in big.json()["error"]["message"]
    missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent/dir"})
    assert missing.status_code == 400 and "not a directory" in missing.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late")
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    # the name again, other weights: the engine freed the old slot, and the new adapter is what runs
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["attn"])})
    assert r.status_code == 200, r.text
    assert _complete(client, "late") == _expected(tiny_model_dir, adapters["attn"])
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200


def test_runtime_updates_need_the_flag(tiny_server):
    assert "SURGE_ALLOW_RUNTIME_LORA_UPDATING" not in os.environ
    headers = {"Authorization": "Bearer test-key"}
    r = httpx.post(f"{tiny_server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"},
                   headers=headers)
    assert r.status_code == 404 and "SURGE_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]
