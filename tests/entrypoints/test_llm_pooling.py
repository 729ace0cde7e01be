"""surge.LLM with runner="pooling": embeddings against sentence-transformers' own encode() of the same tiny
checkpoint (last token + normalize, mean; through chunked prefill too), classification and reranking scores against
HF transformers, and the errors a wrong request or a wrong runner gets."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from surge import LLM
from surge.pooling_params import PoolingParams
from tiny_pooling import (RERANKER_OVERRIDES, save_tiny_classifier, save_tiny_embedding, save_tiny_reranker)

TEXTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog. " * 6, "embeddings", "x" * 40]
ENGINE = dict(max_model_len=512, kv_cache_memory=16 << 20)
COSINE = 0.9999
TOLERANCE = 1e-4


def st_encode(path, texts, **kwargs) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True, **kwargs)


def assert_same_direction(outs, ref: torch.Tensor) -> None:
    for i, (out, want) in enumerate(zip(outs, ref)):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == want.shape, i
        assert F.cosine_similarity(got, want.float(), dim=0).item() >= COSINE, (i, TEXTS[i][:20])


@pytest.fixture(scope="module")
def last_dir(tmp_path_factory):
    return save_tiny_embedding(tmp_path_factory.mktemp("emb") / "last", "lasttoken", normalize=True,
                               config_extra={"matryoshka_dimensions": [16, 32]})


@pytest.fixture(scope="module")
def mean_dir(tmp_path_factory):
    return save_tiny_embedding(tmp_path_factory.mktemp("emb") / "mean", "mean", normalize=False, seed=1)


@pytest.fixture(scope="module")
def last_llm(last_dir):
    return LLM(last_dir, runner="pooling", **ENGINE)


@pytest.mark.parametrize("budget", [None, 16])
def test_last_token_embeddings_match_sentence_transformers(last_dir, budget):
    """Mixed lengths in one batch; a budget of 16 tokens splits the long ones over several prefill chunks."""
    llm = LLM(last_dir, max_num_batched_tokens=budget, **ENGINE)  # runner "auto": a Qwen3Model pools
    assert llm.config.model_config.runner == "pooling"
    assert llm.config.model_config.pooler_config.type == "LAST"
    outs = llm.embed(TEXTS)
    assert_same_direction(outs, st_encode(last_dir, TEXTS))
    for out in outs:
        assert torch.tensor(out.outputs.embedding).norm().item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("budget", [None, 16])
def test_mean_embeddings_match_sentence_transformers(mean_dir, budget):
    llm = LLM(mean_dir, runner="pooling", max_num_batched_tokens=budget, **ENGINE)
    pooler = llm.config.model_config.pooler_config
    assert (pooler.type, pooler.normalize) == ("MEAN", False)
    outs = llm.embed(TEXTS)
    ref = st_encode(mean_dir, TEXTS)
    assert_same_direction(outs, ref)
    for out, want in zip(outs, ref):  # not normalized: the same vector, length included
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want.float(), atol=1e-4, rtol=1e-4)


def test_pooler_config_overrides_the_checkpoint(last_dir, tmp_path):
    """--pooler-config's fields over the sentence-transformers files: mean pooling, no normalization, of the
    same weights as a mean-pooling checkpoint."""
    mean_same_weights = save_tiny_embedding(tmp_path / "mean", "mean", normalize=False,
                                            config_extra={"matryoshka_dimensions": [16, 32]})
    llm = LLM(last_dir, runner="pooling", pooler_config='{"pooling_type": "MEAN", "normalize": false}', **ENGINE)
    assert_same_direction(llm.embed(TEXTS), st_encode(mean_same_weights, TEXTS))


def test_matryoshka_dimensions(last_llm, last_dir):
    outs = last_llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=16))
    assert_same_direction(outs, st_encode(last_dir, TEXTS, truncate_dim=16))
    assert all(torch.tensor(o.outputs.embedding).norm().item() == pytest.approx(1.0, abs=1e-5) for o in outs)
    with pytest.raises(ValueError, match=r"dimensions=20.*supports only \[16, 32\]"):
        last_llm.embed("hi", pooling_params=PoolingParams(dimensions=20))


def test_dimensions_on_a_model_without_matryoshka_is_refused(mean_dir):
    llm = LLM(mean_dir, **ENGINE)
    with pytest.raises(ValueError, match="dimensions=16.*does not support Matryoshka"):
        llm.embed("hi", pooling_params=PoolingParams(dimensions=16))


def test_token_ids_and_prompt_dicts(last_llm):
    ids = list(b"hello world")
    by_ids, by_dict, by_text = last_llm.embed([ids, {"prompt_token_ids": ids}, "hello world"])
    assert by_ids.prompt_token_ids == ids
    torch.testing.assert_close(torch.tensor(by_ids.outputs.embedding), torch.tensor(by_text.outputs.embedding))
    torch.testing.assert_close(torch.tensor(by_dict.outputs.embedding), torch.tensor(by_text.outputs.embedding))


def test_too_long_is_refused_unless_truncation_asks(last_llm):
    text = "y" * 600
    with pytest.raises(ValueError, match="600 tokens.*max_model_len=512.*truncate_prompt_tokens"):
        last_llm.embed(text)
    out, = last_llm.embed(text, truncate_prompt_tokens=100)
    assert len(out.prompt_token_ids) == 100
    want, = last_llm.embed("y" * 100)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), torch.tensor(want.outputs.embedding))


def test_bi_encoder_score_is_the_cosine(last_llm, last_dir):
    query, docs = "what is a fox", ["The quick brown fox", "a lazy dog", "embeddings"]
    scores = [o.outputs.score for o in last_llm.score(query, docs)]
    ref = st_encode(last_dir, [query, *docs])
    want = F.cosine_similarity(ref[:1], ref[1:]).tolist()
    assert scores == pytest.approx(want, abs=TOLERANCE)
    with pytest.raises(ValueError, match="text_1 has 2 entries and text_2 3"):
        last_llm.score([query, query], docs)


def test_encode_is_embed_for_an_embedding_model(last_llm):
    out, = last_llm.encode("hello world")
    emb, = last_llm.embed("hello world")
    assert out.outputs.data.tolist() == pytest.approx(emb.outputs.embedding)


def test_wrong_runner_errors_name_it(last_llm, tiny_model_dir):
    with pytest.raises(ValueError, match="LLM.generate needs a generative model.*runner='pooling'"):
        last_llm.generate("hi")
    with pytest.raises(ValueError, match="LLM.classify.*not supported.*embedding model"):
        last_llm.classify("hi")
    generative = LLM(tiny_model_dir, **ENGINE)
    with pytest.raises(ValueError, match="LLM.embed needs a pooling model.*runner='generate'.*--runner pooling"):
        generative.embed("hi")


# ---- classification and reranking ----

@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return save_tiny_classifier(tmp_path_factory.mktemp("cls") / "qwen3-cls", num_labels=3)


def test_classify_matches_hf(classifier_dir):
    llm = LLM(classifier_dir, max_num_batched_tokens=16, **ENGINE)  # runner "auto": a classifier pools
    outs = llm.classify(TEXTS)
    hf = AutoModelForSequenceClassification.from_pretrained(classifier_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    for text, out in zip(TEXTS, outs):
        with torch.inference_mode():
            logits = hf(torch.tensor([tokenizer.encode(text)])).logits[0]
        assert out.outputs.probs == pytest.approx(torch.softmax(logits, -1).tolist(), abs=TOLERANCE)
    with pytest.raises(ValueError, match="LLM.embed.*not supported.*classifier"):
        llm.embed("hi")


def test_one_label_classifier_scores_pairs_as_hf(tmp_path):
    path = save_tiny_classifier(tmp_path / "ce", num_labels=1, seed=3)
    llm = LLM(path, **ENGINE)
    query, docs = "what is a fox", ["The quick brown fox", "a lazy dog"]
    scores = [o.outputs.score for o in llm.score(query, docs)]
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    for doc, score in zip(docs, scores):
        with torch.inference_mode():
            logit = hf(torch.tensor([tokenizer(text=query, text_pair=doc)["input_ids"]])).logits[0, 0]
        assert score == pytest.approx(torch.sigmoid(logit).item(), abs=TOLERANCE)


def test_yes_no_reranker_matches_hf(tmp_path):
    """Qwen3-Reranker style: the causal LM's P(yes) against P(no) at the last position, as vLLM's hf_overrides
    make it a one-label classifier."""
    path = save_tiny_reranker(tmp_path / "rerank", seed=5)
    llm = LLM(path, runner="pooling", hf_overrides=RERANKER_OVERRIDES, max_num_batched_tokens=16, **ENGINE)
    assert llm.config.model_config.num_labels == 1
    query, docs = "<Query>: fox? ", ["<Document>: The quick brown fox", "<Document>: nothing", "z" * 50]
    scores = [o.outputs.score for o in llm.score(query, docs)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no, yes = ord("n"), ord("y")
    for doc, score in zip(docs, scores):
        with torch.inference_mode():
            logits = hf(torch.tensor([list((query + doc).encode())])).logits[0, -1]
        assert score == pytest.approx(torch.softmax(logits[[no, yes]], -1)[1].item(), abs=TOLERANCE)
