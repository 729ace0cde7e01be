"""Any decoder family as a pooling model: the hidden states before the LM head, for embeddings; or with a
sequence-classification head (`score.weight`, HF's `*ForSequenceClassification`), or a classifier read off the LM
head's rows of some tokens (a decoder reranker such as Qwen3-Reranker: the yes logit minus the no logit).
"""
from __future__ import annotations

import torch
from torch import nn

from surge.config import ModelConfig
from surge.model.arch import CausalLM, ShardId
from surge.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from surge.model.layers.linear import Linear


def as_pooling_model(base: type[CausalLM]) -> type[CausalLM]:
    """The family class `base` without its LM head (kept only when a classifier is read off it)."""

    class PoolingModel(base):
        def __init__(self, config: ModelConfig, quant_config=None) -> None:
            super().__init__(config, quant_config)
            if config.is_cross_encoder and not config.classifier_token_ids:
                self.score = Linear(self.tc.hidden_size, config.num_labels, quantizable=False)
            else:
                self.score = None

        def make_lm_head(self, embed: VocabParallelEmbedding) -> ParallelLMHead | None:
            return super().make_lm_head(embed) if self.config.classifier_token_ids else None

        def checkpoint_name_to_param(self, name: str) -> tuple[str, ShardId] | None:
            mapped = super().checkpoint_name_to_param(name)
            if mapped is not None and mapped[0].startswith("lm_head.") and self.lm_head is None:
                return None  # a causal LM's checkpoint served for its hidden states
            return mapped

        def classify(self, pooled: torch.Tensor) -> torch.Tensor | None:
            """Pooled hidden states [n, hidden] -> class logits [n, num_labels] (on rank 0; None elsewhere)."""
            if self.score is not None:
                return self.score(pooled)
            logits = self.compute_logits(pooled)
            if logits is None:
                return None
            ids = list(self.config.classifier_token_ids)
            picked = logits[:, ids].float()
            if self.config.num_labels == 1 and len(ids) == 2:  # softmax over [false, true] == sigmoid(true - false)
                return picked[:, 1:] - picked[:, :1]
            return picked

    PoolingModel.__name__ = PoolingModel.__qualname__ = base.__name__.replace("ForCausalLM", "ForPooling")
    PoolingModel.__module__ = base.__module__
    return PoolingModel


def is_pooling_model(model: nn.Module) -> bool:
    return hasattr(model, "classify")
