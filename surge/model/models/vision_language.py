"""What the vision-language models share (llava.py's LLaVA and Gemma 3, qwen2_vl.py's Qwen2-VL and Qwen2.5-VL):
images become rows of the input embeddings; all else is the `language_model`, a decoder from this package."""
from __future__ import annotations

import torch

from surge.attention.backend import AttentionMetadata
from surge.model.arch import CausalLM


class VisionLanguageModel(CausalLM):
    """A vision part (the subclass's `embed_images`) beside `language_model` (set by the subclass's __init__), whose
    input embeddings, forward (positions as the decoder takes them: [T], or [3, T] for M-RoPE) and logits the model's
    are."""
    language_model: CausalLM

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, meta, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)


class TiedAsTheVLMSays:
    """For a VLM's decoder class (first among its bases): the LM head tied as the checkpoint's top-level
    tie_word_embeddings says (a VLM's config.json holds it there, not in text_config), else as the decoder's own."""

    def make_lm_head(self, embed):
        tie = self.config.hf_config.get("tie_word_embeddings")
        if tie is not None:
            self.tie_word_embeddings = bool(tie)
        return super().make_lm_head(embed)
