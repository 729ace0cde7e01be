"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP vision tower (transformers' own module, as LLaVA's),
a projector that average-pools the tower's patch grid down to mm_tokens_per_image tokens, RMS-norms them (Gemma's
(1 + w)) and projects them into the decoder, and the Gemma 3 decoder, in which the tokens of each image attend to
each other both ways: transformers' mask is OR(causal, same image) on full layers and AND(window, OR(causal, same
image)) on sliding ones. Surge passes the backend each image token's last visible position (meta.causal_end) and has
the scheduler compute every image in one step (SchedulerConfig.disable_chunked_mm_input). The prompt is laid out by
the checkpoint's Gemma3Processor: each `<start_of_image>` becomes "\\n\\n<start_of_image>", mm_tokens_per_image image
tokens, "<end_of_image>\\n\\n". The math follows transformers 5.24's modeling_gemma3.py."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from surge.model.arch import cfg_get
from surge.model.layers.norm import GemmaRMSNorm
from surge.model.models.gemma import Gemma3ForCausalLM
from surge.model.models.llava import ImageTextModel
from surge.model.models.vision_language import TiedAsTheVLMSays


class Gemma3Projector(nn.Module):
    """[N, patches, vision hidden] -> [N, tokens, text hidden]: the patch grid average-pooled (tokens_per_side^2
    tokens), normed, then times mm_input_projection_weight [vision hidden, text hidden]."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float, patches_per_side: int,
                 tokens_per_side: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_hidden, text_hidden), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)
        self.patches_per_side, self.kernel = patches_per_side, patches_per_side // tokens_per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(n, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3TextModel(TiedAsTheVLMSays, Gemma3ForCausalLM):
    """The decoder; its LM head is tied as the VLM's top-level tie_word_embeddings says."""


class Gemma3ForConditionalGeneration(ImageTextModel):
    # Read by EngineArgs: every image is computed in one step (SchedulerConfig.disable_chunked_mm_input).
    bidirectional_image_attention = True

    def __init__(self, config, quant_config=None) -> None:
        from transformers import AutoConfig, AutoModel
        super().__init__(config, quant_config)
        hf = config.hf_config
        vision = dict(hf["vision_config"])
        vc = AutoConfig.for_model(vision.pop("model_type", "siglip_vision_model"), **vision)
        tokens = int(hf.get("mm_tokens_per_image", 256))
        per_side, patches = round(tokens ** 0.5), vc.image_size // vc.patch_size
        if per_side ** 2 != tokens or patches % per_side:
            raise ValueError(f"mm_tokens_per_image={tokens} must be a square whose side divides the tower's "
                             f"{patches} patches per side (vision_config image_size // patch_size)")
        self.image_token_index = int(hf.get("image_token_index", 262144))
        self.vision_tower = AutoModel.from_config(vc, dtype=config.dtype)
        self.multi_modal_projector = Gemma3Projector(vc.hidden_size, self.tc.hidden_size,
                                                     cfg_get(vc, "layer_norm_eps", 1e-6), patches, per_side)
        self.language_model = Gemma3TextModel(config, quant_config)
        self.tie_word_embeddings = self.language_model.tie_word_embeddings
        for attn in self.language_model.attention_layers():
            attn.params = dataclasses.replace(attn.params, bidirectional_spans=True)

    @classmethod
    def image_token_id(cls, processor) -> int:
        return processor.tokenizer.image_token_id  # the processor's own image_token_id is <start_of_image>'s

    def _embed_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.vision_tower(pixel_values=pixel_values.to(self.config.dtype))
        return self.multi_modal_projector(out.last_hidden_state)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's scaled embeddings; an image token outside the vocabulary reads row 0 (as HF: its row is
        replaced by the image's anyway)."""
        if self.image_token_index >= self.tc.vocab_size:
            input_ids = input_ids.masked_fill(input_ids == self.image_token_index, 0)
        return self.language_model.embed_input_ids(input_ids)
