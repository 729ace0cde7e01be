"""InputProcessor: what both front doors (surge.LLM and AsyncLLM) do to a request before the engine core sees it:
tokenize or render the prompt, and fan n > 1 out into independent seeded child requests.
"""
from __future__ import annotations

from pathlib import Path

from surge.config import EngineConfig
from surge.sampling_params import SamplingParams

Prompt = str | list[int] | dict
Message = dict


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

    def render_chat(self, conversation: list[Message], add_generation_prompt: bool = True,
                    chat_template: str | None = None, **template_kwargs) -> list[int]:
        """Token ids of a conversation rendered by the chat template."""
        return self.tokenizer.encode(self.render_chat_text(conversation, add_generation_prompt, chat_template,
                                                           **template_kwargs), add_special_tokens=False)

    def render_chat_text(self, conversation: list[Message], add_generation_prompt: bool = True,
                         chat_template: str | None = None, **template_kwargs) -> str:
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
