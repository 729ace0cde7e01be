"""`surge serve --runner pooling`: /v1/embeddings through the official openai client (float and base64) against
sentence-transformers, /score, /rerank (and its /v1, /v2 paths) against HF, /classify, their errors in OpenAI's
shape, the runner mismatch both ways, and the metrics counting pooling requests."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from remote_server import RemoteServer
from tiny_pooling import RERANKER_OVERRIDES, save_tiny_embedding, save_tiny_reranker

TEXTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog. " * 2]
ARGS = ("--max-model-len", "128", "--kv-cache-memory", str(16 << 20), "--max-num-batched-tokens", "32")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory):
    return save_tiny_embedding(tmp_path_factory.mktemp("emb") / "last", "lasttoken", normalize=True)


@pytest.fixture(scope="module")
def embed_server(embedding_dir):
    with RemoteServer(embedding_dir, "--runner", "pooling", "--served-model-name", "emb", *ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return save_tiny_reranker(tmp_path_factory.mktemp("rerank") / "qwen3", seed=5)


@pytest.fixture(scope="module")
def rerank_server(reranker_dir):
    import json
    with RemoteServer(reranker_dir, "--runner", "pooling", "--hf-overrides", json.dumps(RERANKER_OVERRIDES),
                      "--served-model-name", "rerank", *ARGS) as server:
        yield server


def st_encode(path, texts) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_client_embeddings(embed_server, embedding_dir, encoding_format):
    client = embed_server.client()
    resp = client.embeddings.create(model="emb", input=TEXTS, encoding_format=encoding_format)
    ref = st_encode(embedding_dir, TEXTS)
    assert [d.index for d in resp.data] == [0, 1, 2]
    for d, want in zip(resp.data, ref):
        got = d.embedding
        if encoding_format == "base64":  # the client hands the string back as it came
            import base64
            import numpy as np
            got = np.frombuffer(base64.b64decode(got), dtype="<f4").tolist()
        assert F.cosine_similarity(torch.tensor(got), want, dim=0).item() >= 0.9999
    num_tokens = sum(len(t.encode()) for t in TEXTS)
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (num_tokens, num_tokens)
    default = client.embeddings.create(model="emb", input="hello world")  # the client asks base64, decodes floats
    assert default.data[0].embedding == pytest.approx(resp.data[0].embedding if encoding_format == "float"
                                                      else ref[0].tolist(), abs=1e-4)


def test_embeddings_of_token_ids(embed_server):
    ids = list(b"hello world")
    with httpx.Client(base_url=embed_server.url, timeout=60) as http:
        one = http.post("/v1/embeddings", json={"input": ids}).json()
        many = http.post("/v1/embeddings", json={"input": [ids, list(b"a")]}).json()
        text = http.post("/v1/embeddings", json={"input": "hello world"}).json()
    assert one["object"] == "list" and one["data"][0]["object"] == "embedding"
    assert one["data"][0]["embedding"] == pytest.approx(text["data"][0]["embedding"], abs=1e-6)
    assert many["data"][0]["embedding"] == pytest.approx(text["data"][0]["embedding"], abs=1e-6)
    assert many["usage"]["prompt_tokens"] == len(ids) + 1


def test_embedding_errors(embed_server):
    with httpx.Client(base_url=embed_server.url, timeout=60) as http:
        too_long = error_of(http.post("/v1/embeddings", json={"input": "y" * 200}))
        assert "200 tokens" in too_long["message"] and "max_model_len=128" in too_long["message"]
        assert too_long["param"] == "input" and too_long["type"] == "invalid_request_error"
        cut = http.post("/v1/embeddings", json={"input": "y" * 200, "truncate_prompt_tokens": 50}).json()
        assert cut["usage"]["prompt_tokens"] == 50
        dims = error_of(http.post("/v1/embeddings", json={"input": "hi", "dimensions": 16}))
        assert dims["param"] == "dimensions" and "Matryoshka" in dims["message"]
        fmt = error_of(http.post("/v1/embeddings", json={"input": "hi", "encoding_format": "int8"}))
        assert fmt["param"] == "encoding_format"
        assert error_of(http.post("/v1/embeddings", json={"input": []}))["param"] == "input"
        assert error_of(http.post("/v1/embeddings", json={"input": [1 << 20]}))["param"] == "input"
        for path in ("/v1/completions", "/v1/chat/completions"):
            err = error_of(http.post(path, json={"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}))
            assert "needs a generative model" in err["message"] and "runner='pooling'" in err["message"]
        assert "classifier" not in error_of(http.post("/classify", json={"input": "hi"}))["message"]


def test_bi_encoder_score(embed_server, embedding_dir):
    with httpx.Client(base_url=embed_server.url, timeout=60) as http:
        body = http.post("/score", json={"text_1": "fox", "text_2": ["a fox", "a dog"]}).json()
        v1 = http.post("/v1/score", json={"text_1": "fox", "text_2": ["a fox", "a dog"]}).json()
    ref = st_encode(embedding_dir, ["fox", "a fox", "a dog"])
    want = F.cosine_similarity(ref[:1], ref[1:]).tolist()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=TOLERANCE)
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "score"
    assert [d["score"] for d in v1["data"]] == pytest.approx(want, abs=TOLERANCE)


def hf_yes_probability(path, text: str) -> float:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([list(text.encode())])).logits[0, -1]
    return torch.softmax(logits[[ord("n"), ord("y")]], -1)[1].item()


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_matches_hf(rerank_server, reranker_dir, path):
    query, docs = "<Query>: fox? ", ["<Doc>: a fox", "<Doc>: nothing at all", "<Doc>: zz"]
    with httpx.Client(base_url=rerank_server.url, timeout=60) as http:
        body = http.post(path, json={"model": "rerank", "query": query, "documents": docs, "top_n": 2}).json()
    want = [hf_yes_probability(reranker_dir, query + d) for d in docs]
    order = sorted(range(3), key=lambda i: want[i], reverse=True)[:2]
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=TOLERANCE)
        assert r["document"] == {"text": docs[r["index"]]}
    assert body["usage"]["total_tokens"] == sum(len(query + d) for d in docs)


def test_cross_encoder_score_and_classify(rerank_server, reranker_dir):
    with httpx.Client(base_url=rerank_server.url, timeout=60) as http:
        score = http.post("/score", json={"text_1": ["q1 ", "q2 "], "text_2": ["d1", "d2"]}).json()
        classify = http.post("/classify", json={"input": ["q1 d1"]}).json()
        mismatch = error_of(http.post("/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}))
        embed = error_of(http.post("/v1/embeddings", json={"input": "hi"}))
        empty = error_of(http.post("/rerank", json={"query": "q", "documents": []}))
    assert [d["score"] for d in score["data"]] == pytest.approx(
        [hf_yes_probability(reranker_dir, "q1 d1"), hf_yes_probability(reranker_dir, "q2 d2")], abs=TOLERANCE)
    assert classify["data"][0]["probs"] == pytest.approx([score["data"][0]["score"]], abs=TOLERANCE)
    assert classify["data"][0]["num_classes"] == 1
    assert "text_1 has 2 entries and text_2 3" in mismatch["message"]
    assert "classifier" in embed["message"] and empty["param"] == "documents"


def test_generative_server_refuses_pooling_routes(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as http:
        for path, body in (("/v1/embeddings", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"}),
                           ("/rerank", {"query": "a", "documents": ["b"]}), ("/classify", {"input": "hi"})):
            err = error_of(http.post(path, json=body))
            assert "needs a pooling model" in err["message"] and "runner='generate'" in err["message"], path
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        tiny_server.client().embeddings.create(model="tiny", input="hi")


def test_metrics_count_pooling_requests(embed_server):
    before = embed_server.metrics()
    with httpx.Client(base_url=embed_server.url, timeout=60) as http:
        http.post("/v1/embeddings", json={"input": ["abc", "defgh"]}).raise_for_status()
    after = embed_server.wait_idle()
    assert after["surge:prompt_tokens_total"] - before.get("surge:prompt_tokens_total", 0) == 8
    assert after["surge:request_success_total{stop}"] - before.get("surge:request_success_total{stop}", 0) == 2
