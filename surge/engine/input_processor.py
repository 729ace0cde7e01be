"""InputProcessor: what both front doors (surge.LLM and AsyncLLM) do to a request before the engine core sees it:
tokenize or render the prompt (a multimodal one through the model's own HF processor), and fan n > 1 out into
independent seeded child requests.
"""
from __future__ import annotations

from pathlib import Path

from surge.config import EngineConfig
from surge.engine import deepseek_v4_prompt
from surge.multimodal import MultiModalFeature
from surge.multimodal.media import MediaConnector
from surge.sampling_params import SamplingParams

Prompt = str | list[int] | dict
Message = dict

DEFAULT_IMAGES_PER_PROMPT = 16  # limit_mm_per_prompt's default for images
IMAGE_PARTS = ("image_url", "image")  # chat content parts that carry an image
# Architectures whose checkpoints ship no Jinja chat template: their own prompt encoder renders a conversation
# (unless a chat_template is given), as vLLM's tokenizer modes of the same names do.
PROMPT_ENCODERS = {"DeepseekV4ForCausalLM": deepseek_v4_prompt}


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many types here; the user needs the directory and the cause
        raise ValueError(f"model={str(model_dir)!r}: cannot load its tokenizer ({type(e).__name__}: {e})") from None


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._hf_processor = None  # the model's AutoProcessor, loaded with the first image
        mc = config.model_config
        self.media = MediaConnector(mc.allowed_local_media_path, mc.allowed_media_domains)
        self.prompt_encoder = PROMPT_ENCODERS.get(mc.architecture)

    def process(self, prompt: Prompt) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """tokenize(), or for {"prompt": ..., "multi_modal_data": {"image": PIL image or list}} the model's processor:
        (text, token ids with each image's placeholders expanded, one feature per image)."""
        if not (isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None):
            features = prompt.get("mm_features", []) if isinstance(prompt, dict) else []  # processed already
            return (*self.tokenize(prompt), features)
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError("a prompt with multi_modal_data needs its text as 'prompt' (a string with the model's "
                             "image placeholder where each image goes)")
        text = prompt["prompt"]
        token_ids, features = self.process_images(text, prompt["multi_modal_data"])
        return text, token_ids, features

    def process_images(self, text: str, mm_data: dict, add_special_tokens: bool = True
                       ) -> tuple[list[int], list[MultiModalFeature]]:
        from PIL import Image
        model_class = self._multimodal_model_class()
        if not isinstance(mm_data, dict) or set(mm_data) - {"image"}:
            raise ValueError(f"multi_modal_data must be a dict with the key 'image', got "
                             f"{sorted(mm_data) if isinstance(mm_data, dict) else type(mm_data).__name__}")
        images = mm_data.get("image")
        images = [] if images is None else images if isinstance(images, (list, tuple)) else [images]
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got "
                                 f"{type(image).__name__}")
        self.check_image_count(len(images))
        images = [image.convert("RGB") for image in images]
        token_ids, features = model_class.process_prompt(self.hf_processor(), text, images, add_special_tokens)
        sc = self.config.scheduler_config
        longest = max((f.length for f in features), default=0)
        if sc.disable_chunked_mm_input and longest > sc.max_num_batched_tokens:
            raise ValueError(f"an image of {longest} tokens does not fit in one step of max_num_batched_tokens="
                             f"{sc.max_num_batched_tokens}, and this model computes each image in one step; raise "
                             "max_num_batched_tokens")
        return token_ids, features

    def check_image_count(self, count: int) -> None:
        limit = self.config.model_config.limit_mm_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT)
        if count > limit:
            raise ValueError(f"the prompt has {count} images, over limit_mm_per_prompt={{'image': {limit}}} "
                             "(--limit-mm-per-prompt)")

    def hf_processor(self):
        """The model's processor: its class's `load_processor` where it has one, else transformers' AutoProcessor."""
        if self._hf_processor is None:
            from transformers import AutoProcessor
            model = self.config.model_config.model
            load = getattr(self._multimodal_model_class(), "load_processor", AutoProcessor.from_pretrained)
            try:
                self._hf_processor = load(str(model))
            except Exception as e:  # as load_tokenizer: many types; the user needs the directory and the cause
                raise ValueError(f"model={str(model)!r}: cannot load its processor ({type(e).__name__}: {e})"
                                 ) from None
        return self._hf_processor

    def image_placeholder(self) -> str | None:
        """The text that stands for one image in a prompt; None for a model that takes no images."""
        try:
            cls = self._multimodal_model_class()
        except ValueError:
            return None
        return cls.image_placeholder(self.hf_processor())

    def _multimodal_model_class(self):
        from surge.model.models.registry import get_model_class
        mc = self.config.model_config
        cls = get_model_class(mc.architecture, mc.runner)
        if not hasattr(cls, "process_prompt"):
            raise ValueError(f"model={mc.model!r} ({mc.architecture}) takes no image input: multi_modal_data and "
                             "image content parts need a multimodal model (e.g. LlavaForConditionalGeneration)")
        return cls

    def render_chat_prompt(self, conversation: list[Message], add_generation_prompt: bool = True,
                           chat_template: str | None = None, **template_kwargs) -> dict:
        """A conversation as a prompt dict: {"prompt_token_ids"} for text only; with image parts (`image_url` with
        a data: URL, or `image` with a PIL image), the rendered text with the model's placeholder for each image and
        its `multi_modal_data`, processed here."""
        images, flat = [], []
        for message in conversation:
            content = message.get("content")
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
                                                 for p in content):
                placeholder = self._multimodal_model_class().image_placeholder(self.hf_processor())
                texts = []
                for part in content:
                    if part.get("type") in IMAGE_PARTS:
                        images.append(self._part_image(part))
                        texts.append(placeholder)
                    else:
                        texts.append(part.get("text", ""))
                message = {**message, "content": "\n".join(texts)}
            flat.append(message)
        if not images:
            return {"prompt_token_ids": self.render_chat(conversation, add_generation_prompt, chat_template,
                                                         **template_kwargs)}
        text = self.render_chat_text(flat, add_generation_prompt, chat_template, **template_kwargs)
        token_ids, features = self.process_images(text, {"image": images}, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": token_ids, "mm_features": features}

    def _part_image(self, part: dict):
        """The PIL image of one chat content part: {"type": "image_url", "image_url": {"url": ...}} (or the URL as
        a string: data:, or a file or host the config allows), or {"type": "image", "image": PIL image}."""
        from PIL import Image
        if part["type"] == "image":
            image = part.get("image")
            if not isinstance(image, Image.Image):
                raise ValueError(f"an 'image' content part needs a PIL image as 'image', got {type(image).__name__}")
            return image
        url = part.get("image_url")
        return self.media.load_image(url.get("url") if isinstance(url, dict) else url)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": ...} -> (text, token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def template_variables(self, chat_template: str | None) -> frozenset[str] | None:
        """The kwargs the model's own prompt encoder reads; None when a Jinja template renders (it reads its own)."""
        return self.prompt_encoder.TEMPLATE_VARIABLES if chat_template is None and self.prompt_encoder else None

    def render_chat(self, conversation: list[Message], add_generation_prompt: bool = True,
                    chat_template: str | None = None, **template_kwargs) -> list[int]:
        """Token ids of a conversation rendered by the chat template."""
        return self.tokenizer.encode(self.render_chat_text(conversation, add_generation_prompt, chat_template,
                                                           **template_kwargs), add_special_tokens=False)

    def render_chat_text(self, conversation: list[Message], add_generation_prompt: bool = True,
                         chat_template: str | None = None, **template_kwargs) -> str:
        if chat_template is None and self.prompt_encoder is not None:
            unknown = sorted(set(template_kwargs) - self.prompt_encoder.TEMPLATE_VARIABLES - {"tools"})
            if unknown:
                raise ValueError(f"{self.config.model_config.architecture}'s prompt format takes no "
                                 f"{', '.join(unknown)}; it reads "
                                 f"{', '.join(sorted(self.prompt_encoder.TEMPLATE_VARIABLES))}")
            return self.prompt_encoder.render(conversation, add_generation_prompt, **template_kwargs)
        if chat_template is None and not self.tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template= or use generate()")
        # The template writes the special tokens (BOS ...) itself, so the caller encodes without adding them.
        return self.tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                                  add_generation_prompt=add_generation_prompt, **template_kwargs)

    def fan_out(self, request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """(child id, one-sample params) per sample: `{id}-{i}` with seed + i when n > 1, else the id itself.
        The model's EOS ids are filled in here."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        eos = self.config.model_config.eos_token_ids
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            children.append((f"{request_id}-{i}" if params.n > 1 else request_id,
                             params.clone(n=1, seed=seed, _eos_token_ids=eos)))
        return children
