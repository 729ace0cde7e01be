"""surge.LLM: offline generation and chat, or (runner="pooling") embeddings, classification and scores, driving an
in-process EngineCore.

`LLM()` with no model uses the embedded default model (SmolLM2-135M-Instruct).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from surge.engine.args import EngineArgs
from surge.engine.core import EngineCore
from surge.engine.input_processor import InputProcessor, Message, Prompt, load_tokenizer
from surge.engine.output_processor import OutputProcessor
from surge.engine.pooling import (PROMPT_ONLY, check_generation, check_pooling_task, fit_prompt, pair_token_ids,
                                  pooling_params_for, score_pairs)
from surge.engine.sentence_transformers_config import default_prompt
from surge.core.request import Request, RequestStatus
from surge.lora.checker import AdapterChecker
from surge.lora_request import LoRARequest
from surge.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput,
                           RequestOutput, ScoringRequestOutput)
from surge.pooling_params import PoolingParams
from surge.sampling_params import SamplingParams

LoRAs = LoRARequest | Sequence[LoRARequest | None] | None  # one adapter for every prompt, or one per prompt


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str = "auto", **engine_kwargs) -> None:
        """engine_kwargs: EngineArgs's fields (surge/engine/args.py)."""
        self.config = EngineArgs(model, dtype=dtype, **engine_kwargs).create_engine_config()
        self.tokenizer = load_tokenizer(self.config.model_config.model)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.engine = EngineCore(self.config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # sentence-transformers' default prompt, put before every text to embed, as its encode() does
        self._embed_prompt = default_prompt(self.config.model_config.model)
        self._adapters = AdapterChecker(self.config)

    # ---- generation ----
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRAs = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, {"prompt": ...} / {"prompt_token_ids": ...}, or a list of these;
        a multimodal model takes {"prompt": ..., "multi_modal_data": {"image": PIL image or list}}, the prompt with
        the model's image placeholder where each image goes. lora_request: the adapter of every prompt, or one per
        prompt (None: the base model)."""
        check_generation(self.config.model_config, "LLM.generate")
        prompts = _prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        loras = self._loras_per_prompt(lora_request, len(prompts))
        request_ids = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                request_ids.append(self._add_request(prompt, params, lora))
        except Exception:
            for rid in request_ids:
                self.abort(rid)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRAs = None,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             **template_kwargs) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations. Content may be
        a list of parts: text, and for a multimodal model images ({"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}} or {"type": "image", "image": PIL image})."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [self.input_processor.render_chat_prompt(conv, add_generation_prompt, chat_template,
                                                           **template_kwargs) for conv in messages]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    # ---- pooling (runner="pooling") ----
    def encode(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None, lora_request: LoRAs = None) -> list[PoolingRequestOutput]:
        """The model's pooled output of each prompt (pooling_task: embed, classify; default: the model's own).
        lora_request: as generate's, the adapter applied to the model's layers (its head stays the base's)."""
        mc = self.config.model_config
        task = pooling_task or ("classify" if mc.is_cross_encoder else "embed")
        check_pooling_task(mc, task, "LLM.encode")
        return self._pool(_prompt_list(prompts), pooling_params, task, truncate_prompt_tokens, use_tqdm, lora_request)

    def embed(self, prompts: Prompt | Sequence[Prompt], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              lora_request: LoRAs = None) -> list[EmbeddingRequestOutput]:
        check_pooling_task(self.config.model_config, "embed", "LLM.embed")
        prompts = [self._embed_prompt + p if isinstance(p, str) else p for p in _prompt_list(prompts)]
        outs = self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm, lora_request)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: Prompt | Sequence[Prompt], *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True, pooling_params: PoolingParams | None = None, lora_request: LoRAs = None
                 ) -> list[ClassificationRequestOutput]:
        check_pooling_task(self.config.model_config, "classify", "LLM.classify")
        outs = self._pool(_prompt_list(prompts), pooling_params, "classify", truncate_prompt_tokens, use_tqdm,
                          lora_request)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: str | list[int] | Sequence, data_2: str | list[int] | Sequence, /, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: LoRAs = None) -> list[ScoringRequestOutput]:
        """data_1 against each of data_2 (or pairwise when both are lists of one length). A cross-encoder scores
        each pair together (its classifier, as the model defines it); an embedding model by the cosine of the two
        embeddings."""
        mc = self.config.model_config
        check_pooling_task(mc, "score", "LLM.score")
        pairs = score_pairs(_prompt_list(data_1), _prompt_list(data_2))
        if mc.is_cross_encoder:
            prompts = [{"prompt_token_ids": pair_token_ids(self.tokenizer, a, b)} for a, b in pairs]
            outs = self._pool(prompts, pooling_params, "score", truncate_prompt_tokens, use_tqdm, lora_request)
            return [ScoringRequestOutput.from_base(o) for o in outs]
        firsts = self.embed([a for a, _ in pairs], truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                            pooling_params=pooling_params, lora_request=lora_request)
        seconds = self.embed([b for _, b in pairs], truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                             pooling_params=pooling_params, lora_request=lora_request)
        outs = []
        for a, b in zip(firsts, seconds):
            cosine = F.cosine_similarity(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding), dim=0)
            outs.append(ScoringRequestOutput.from_base(PoolingRequestOutput(
                f"{a.request_id}_{b.request_id}", PoolingOutput(cosine), a.prompt_token_ids + b.prompt_token_ids)))
        return outs

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
    def _pool(self, prompts: list[Prompt], pooling_params: PoolingParams | Sequence[PoolingParams] | None, task: str,
              truncate_prompt_tokens: int | None, use_tqdm: bool, lora_request: LoRAs = None
              ) -> list[PoolingRequestOutput]:
        mc = self.config.model_config
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params] * len(prompts)
        pooling_params = list(pooling_params)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"pooling_params has {len(pooling_params)} entries but there are {len(prompts)} prompts")
        loras = self._loras_per_prompt(lora_request, len(prompts))
        request_ids = []
        try:
            for prompt, params, lora in zip(prompts, pooling_params, loras):
                if params is not None and not isinstance(params, PoolingParams):
                    raise ValueError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
                params = pooling_params_for(mc, params, task)
                if truncate_prompt_tokens is not None:
                    params = params.clone(truncate_prompt_tokens=truncate_prompt_tokens)
                text, token_ids = self.input_processor.tokenize(prompt)
                token_ids = fit_prompt(token_ids, params, self.config.scheduler_config.max_model_len)
                request_id = str(next(self._ids))
                self.engine.add_request(Request(request_id, token_ids, PROMPT_ONLY,
                                                self.config.cache_config.block_size, pooling_params=params,
                                                lora_request=lora))
                self.output_processor.add_request(request_id, text, token_ids, [(request_id, PROMPT_ONLY)],
                                                  pooling=True)
                request_ids.append(request_id)
        except Exception:
            for rid in request_ids:
                self.abort(rid)
            raise
        return self._run(request_ids, use_tqdm)

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries but there are {n} prompts")
        return sampling_params

    def _loras_per_prompt(self, lora_request, n: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each checked before any request is added."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * n
        else:
            loras = list(lora_request)
            if len(loras) != n:
                raise ValueError(f"lora_request has {len(loras)} entries but there are {n} prompts")
        for lora in dict.fromkeys(loras):
            if lora is not None:
                self._adapters.check(lora)
        return loras

    def _add_request(self, prompt: Prompt, params: SamplingParams, lora: LoRARequest | None = None) -> str:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text, token_ids, mm_features = self.input_processor.process(prompt)
        request_id = str(next(self._ids))
        children = self.input_processor.fan_out(request_id, params)
        added = []
        try:
            for child_id, child_params in children:
                self.engine.add_request(Request(child_id, token_ids, child_params, self.config.cache_config.block_size,
                                                lora_request=lora, mm_features=mm_features))
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


def _prompt_list(prompts) -> list[Prompt]:
    """One prompt (a string, a dict, a list of token ids) or a list of them -> a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
