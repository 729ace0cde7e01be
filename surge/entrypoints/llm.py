"""surge.LLM: offline generation and chat, driving an in-process EngineCore.

`LLM()` with no model uses the embedded default model (SmolLM2-135M-Instruct).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from surge.engine.args import EngineArgs
from surge.engine.core import EngineCore
from surge.engine.input_processor import InputProcessor, Message, Prompt, load_tokenizer
from surge.engine.output_processor import OutputProcessor
from surge.core.request import Request, RequestStatus
from surge.outputs import RequestOutput
from surge.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str = "auto", **engine_kwargs) -> None:
        """engine_kwargs: EngineArgs's fields (surge/engine/args.py)."""
        self.config = EngineArgs(model, dtype=dtype, **engine_kwargs).create_engine_config()
        self.tokenizer = load_tokenizer(self.config.model_config.model)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.engine = EngineCore(self.config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    # ---- generation ----
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, {"prompt": ...} / {"prompt_token_ids": ...}, or a list of these."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_ids.append(self._add_request(prompt, params))
        except Exception:
            for rid in request_ids:
                self.abort(rid)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             **template_kwargs) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [self.render_chat(conv, add_generation_prompt, chat_template, **template_kwargs)
                   for conv in messages]
        return self.generate([{"prompt_token_ids": ids} for ids in prompts], sampling_params, use_tqdm)

    def render_chat(self, conversation: list[Message], add_generation_prompt: bool = True,
                    chat_template: str | None = None, **template_kwargs) -> list[int]:
        return self.input_processor.render_chat(conversation, add_generation_prompt, chat_template,
                                                **template_kwargs)

    def get_tokenizer(self):
        return self.tokenizer

    def abort(self, request_id: str) -> None:
        self.engine.abort_requests(self.output_processor.abort(request_id))

    def reset_prefix_cache(self) -> bool:
        return self.engine.kv_cache_manager.reset_prefix_cache()

    # ---- internals ----
    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries but there are {n} prompts")
        return sampling_params

    def _add_request(self, prompt: Prompt, params: SamplingParams) -> str:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = self.input_processor.tokenize(prompt)
        request_id = str(next(self._ids))
        children = self.input_processor.fan_out(request_id, params)
        added = []
        try:
            for child_id, child_params in children:
                self.engine.add_request(Request(child_id, token_ids, child_params,
                                                self.config.cache_config.block_size))
                added.append(child_id)
        except Exception:
            self.engine.abort_requests(added)
            raise
        self.output_processor.add_request(request_id, text, token_ids, children)
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm or len(request_ids) < 2)
        try:
            while self.engine.has_unfinished_requests():
                outputs, to_stop = self.output_processor.process(self.engine.step())
                if to_stop:
                    self.engine.finish_requests(to_stop, RequestStatus.FINISHED_STOPPED)
                for out in outputs:
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in request_ids:
                if rid not in final:
                    self.abort(rid)
            raise
        finally:
            bar.close()
        return [final[rid] for rid in request_ids]
