"""Tiny random pooling checkpoints for fast tests: a Qwen3 embedding model saved by sentence-transformers itself
(its modules.json, pooling and Normalize files), a Qwen3ForSequenceClassification, and a causal Qwen3 to serve as a
yes/no-logit reranker. Built with transformers and sentence-transformers from configs, never from a hub.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForSequenceClassification, Qwen3Config

from tiny_models import _COMMON, byte_tokenizer, make_tiny_model

# The yes/no reranker over the byte tokenizer: one-character tokens stand for "no" and "yes".
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["n", "y"],
                      "is_original_qwen3_reranker": True}


def _randomize(model: torch.nn.Module) -> None:
    """As tests/tiny_models.save_tiny: norms away from 1, so a skipped norm shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def _tokenizer():
    tok = byte_tokenizer()
    tok.pad_token = "<0>"  # sentence-transformers pads its batches
    return tok


def save_tiny_embedding(path: Path, pooling_mode: str = "lasttoken", normalize: bool = True, seed: int = 0,
                        prompts: dict[str, str] | None = None, config_extra: dict | None = None) -> Path:
    """A Qwen3Model saved by sentence-transformers: Transformer -> Pooling(pooling_mode) [-> Normalize]."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    raw = path.parent / f"{path.name}-hf"
    torch.manual_seed(seed)
    model = AutoModel.from_config(Qwen3Config(**_COMMON, rope_theta=1000000.0, **(config_extra or {})),
                                  dtype=torch.float32)
    _randomize(model)
    model.save_pretrained(raw)
    _tokenizer().save_pretrained(raw)
    transformer = models.Transformer(str(raw))
    modules = [transformer, models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, prompts=prompts or {}).save(str(path))
    return path


def save_tiny_classifier(path: Path, num_labels: int = 3, seed: int = 0) -> Path:
    """A Qwen3ForSequenceClassification (score head `score.weight`), pad id 0."""
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(
        Qwen3Config(**_COMMON, rope_theta=1000000.0, num_labels=num_labels, pad_token_id=0), dtype=torch.float32)
    _randomize(model)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # decisive classes: a mistake moves the probabilities
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def save_tiny_reranker(path: Path, seed: int = 0) -> Path:
    """A causal Qwen3 to serve with RERANKER_OVERRIDES (as hf_overrides)."""
    return make_tiny_model("qwen3", path, seed)
