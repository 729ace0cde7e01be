"""LLaVA-style vision-language models (LlavaForConditionalGeneration): a vision tower (CLIP or SigLIP), a two-layer
projector, and a decoder from this package; image embeddings replace the prompt's `<image>` placeholder tokens.
`ImageTextModel` holds what such models share (Gemma 3's, gemma3_mm.py, too).

The vision tower is transformers' own module, replicated on every rank and run eagerly (SDPA, no KV cache);
`embed_images` runs it and the projector, and `forward` takes the merged `inputs_embeds` from the runner.
The front end calls `process_prompt` with the model's HF processor: placeholders expanded, pixels per image.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from surge.model.arch import refuse
from surge.model.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from surge.model.models.mistral import MistralForCausalLM
from surge.model.models.vision_language import VisionLanguageModel
from surge.multimodal import MultiModalFeature

TEXT_MODELS = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        from transformers.activations import ACT2FN
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ImageTextModel(VisionLanguageModel):
    """What LLaVA-style models share (Gemma 3 too): a vision tower and projector (`_embed_pixels`, the subclass's)
    whose rows replace each image's run of placeholder tokens in the `language_model`'s input; transformers-style
    checkpoint names (`vision_tower`, `multi_modal_projector`, `language_model`)."""

    # ---- the front end's part: the HF processor's output as token ids and one feature per image ----
    @classmethod
    def image_placeholder(cls, processor) -> str:
        return processor.image_token

    @classmethod
    def image_token_id(cls, processor) -> int:
        """The id of the tokens an image's embeddings replace (the processor expands each placeholder to a run)."""
        return processor.image_token_id

    @classmethod
    def process_prompt(cls, processor, text: str, images: list, add_special_tokens: bool = True
                       ) -> tuple[list[int], list[MultiModalFeature]]:
        """One feature per processed image (pixel_values row) and its run of image tokens, in order; a processor
        that adds crops of an image (Gemma 3's pan-and-scan) gives each crop its own run."""
        placeholder = cls.image_placeholder(processor)
        if text.count(placeholder) != len(images):
            raise ValueError(f"the prompt has {text.count(placeholder)} image placeholder(s) ({placeholder!r}) for "
                             f"{len(images)} image(s) in multi_modal_data; put one {placeholder!r} where each image "
                             "goes")
        out = processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=add_special_tokens)
        ids = out["input_ids"][0].tolist()
        if not images:
            return ids, []
        image_token = cls.image_token_id(processor)
        positions = [i for i, t in enumerate(ids) if t == image_token]
        pixel_values = out["pixel_values"]
        per_image = len(positions) // len(pixel_values)
        features = []
        for k, pixels in enumerate(pixel_values):
            offset = positions[k * per_image]
            if positions[(k + 1) * per_image - 1] != offset + per_image - 1:
                raise ValueError(f"the prompt's image tokens ({image_token}) are not one run of {per_image} per "
                                 "image: the token may appear in the text only where the processor puts it")
            features.append(MultiModalFeature.of(pixels.float(), offset, per_image))
        return ids, features

    # ---- the runner's part ----
    def embed_images(self, features: list[MultiModalFeature], device: torch.device) -> list[torch.Tensor]:
        """Each image's embeddings [tokens per image, hidden]; images of one pixel shape run as one batch."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, f in enumerate(features):
            by_shape.setdefault(tuple(f.shape), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(features)
        for group in by_shape.values():
            embeds = self._embed_pixels(torch.stack([features[i].pixel_values(device) for i in group]))
            for i, rows in zip(group, embeds):
                out[i] = rows
        return out

    def _embed_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, tokens per image, hidden]."""
        raise NotImplementedError

    def checkpoint_name_to_param(self, name: str):
        """transformers 5 (`model.vision_tower.*`, `model.language_model.*`, `lm_head.*`) and older saves
        (`vision_tower.vision_model.*`, `language_model.model.*`, `language_model.lm_head.*`)."""
        name = re.sub(r"^model\.(?=vision_tower|multi_modal_projector|language_model)", "", name)
        if name.startswith("vision_tower."):
            return "vision_tower." + name[len("vision_tower."):].removeprefix("vision_model."), None
        if name.startswith("multi_modal_projector."):
            return name, None
        if name.startswith("language_model."):
            inner = name[len("language_model."):]
            name = inner if inner.startswith(("model.", "lm_head.")) else "model." + inner
        mapped = self.language_model.checkpoint_name_to_param(name)
        return None if mapped is None else ("language_model." + mapped[0], mapped[1])


class LlavaForConditionalGeneration(ImageTextModel):
    def __init__(self, config, quant_config=None) -> None:
        from transformers import AutoConfig, AutoModel
        super().__init__(config, quant_config)
        hf = config.hf_config
        text_type = self.tc.model_type
        if text_type not in TEXT_MODELS:
            raise refuse("text_config.model_type", text_type, ", ".join(TEXT_MODELS))
        vision = dict(hf["vision_config"])
        vision_config = AutoConfig.for_model(vision.pop("model_type", "clip_vision_model"), **vision)
        self.feature_layers = hf.get("vision_feature_layer", -2)
        self.select_strategy = hf.get("vision_feature_select_strategy") or "default"
        if self.select_strategy not in ("default", "full"):
            raise refuse("vision_feature_select_strategy", self.select_strategy, "'default', 'full'")
        self.vision_tower = AutoModel.from_config(vision_config, dtype=config.dtype)
        layers = 1 if isinstance(self.feature_layers, int) else len(self.feature_layers)
        self.multi_modal_projector = LlavaProjector(vision_config.hidden_size * layers, self.tc.hidden_size,
                                                    hf.get("projector_hidden_act", "gelu"),
                                                    hf.get("multimodal_projector_bias", True))
        self.language_model = TEXT_MODELS[text_type](config, quant_config)
        self.tie_word_embeddings = self.language_model.tie_word_embeddings

    def _embed_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, tokens per image, hidden]: the vision tower's chosen layer(s), projected."""
        out = self.vision_tower(pixel_values.to(self.config.dtype), output_hidden_states=True)
        layers = [self.feature_layers] if isinstance(self.feature_layers, int) else self.feature_layers
        hidden = [out.hidden_states[i] for i in layers]
        if self.select_strategy == "default":  # drop the CLS token
            hidden = [h[:, 1:] for h in hidden]
        return self.multi_modal_projector(torch.cat(hidden, dim=-1))
