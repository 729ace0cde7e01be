"""The pooling routes of a `--runner pooling` server: POST /v1/embeddings, /score (/v1/score), /rerank (/v1/rerank,
/v2/rerank) and /classify. A generative server answers them with a 400 naming its runner."""
from __future__ import annotations

import base64

import numpy as np
import torch
import torch.nn.functional as F
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from surge.engine.pooling import (WrongRunnerError, check_pooling_task, fit_prompt, pair_token_ids,
                                  pooling_params_for, score_pairs)
from surge.engine.sentence_transformers_config import default_prompt
from surge.entrypoints.openai.errors import bad_request
from surge.entrypoints.openai.pooling_protocol import (ClassificationData, ClassificationRequest,
                                                       ClassificationResponse, EmbeddingData, EmbeddingRequest,
                                                       EmbeddingResponse, RerankDocument, RerankRequest,
                                                       RerankResponse, RerankResult, RerankUsage, ScoreData,
                                                       ScoreRequest, ScoreResponse)
from surge.entrypoints.openai.protocol import UsageInfo
from surge.entrypoints.openai.serving import OpenAIServing, encode, now, random_id
from surge.outputs import PoolingRequestOutput
from surge.pooling_params import PoolingParams

ENCODING_FORMATS = ("float", "base64")


def _json(obj) -> Response:
    return Response(encode(obj), media_type="application/json")


class PoolingHandler:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.model_config = serving.engine.config.model_config
        self.embed_prompt = default_prompt(self.model_config.model) if self.model_config.runner == "pooling" else ""

    # ---- routes ----
    async def embeddings(self, req: EmbeddingRequest, http: HTTPRequest) -> Response:
        model = self._check(req.model, "embed", "/v1/embeddings")
        if req.encoding_format not in ENCODING_FORMATS:
            raise bad_request(f"encoding_format={req.encoding_format!r} is invalid; allowed: "
                              f"{', '.join(ENCODING_FORMATS)}", param="encoding_format")
        params = self._params("embed", dimensions=req.dimensions, normalize=req.normalize,
                              truncate_prompt_tokens=req.truncate_prompt_tokens)
        prompts = self._inputs(req.input, "input", self.embed_prompt, req.add_special_tokens)
        outs = await self._run(http, prompts, params, "input", "embd-", model)
        data = [EmbeddingData(i, _encode_embedding(o.outputs.data, req.encoding_format)) for i, o in enumerate(outs)]
        return _json(EmbeddingResponse(random_id("embd-"), now(), model, data, _usage(outs)))

    async def classify(self, req: ClassificationRequest, http: HTTPRequest) -> Response:
        model = self._check(req.model, "classify", "/classify")
        params = self._params("classify", truncate_prompt_tokens=req.truncate_prompt_tokens)
        outs = await self._run(http, self._inputs(req.input, "input", "", req.add_special_tokens), params, "input",
                               "classify-", model)
        labels = self.model_config.hf_config.get("id2label") or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            best = int(np.argmax(probs))
            data.append(ClassificationData(i, labels.get(str(best), labels.get(best)), probs, len(probs)))
        return _json(ClassificationResponse(random_id("classify-"), now(), model, data, _usage(outs)))

    async def score(self, req: ScoreRequest, http: HTTPRequest) -> Response:
        model = self._check(req.model, "score", "/score")
        firsts = self._texts(req.text_1, "text_1")
        seconds = self._texts(req.text_2, "text_2")
        try:
            pairs = score_pairs(firsts, seconds)
        except ValueError as e:
            raise bad_request(str(e), param="text_2") from None
        scores, outs = await self._scores(http, pairs, req.truncate_prompt_tokens, model)
        data = [ScoreData(i, s) for i, s in enumerate(scores)]
        return _json(ScoreResponse(random_id("score-"), now(), model, data, _usage(outs)))

    async def rerank(self, req: RerankRequest, http: HTTPRequest) -> Response:
        model = self._check(req.model, "score", "/rerank")
        if not req.documents:
            raise bad_request("documents is empty: give at least one document", param="documents")
        if req.top_n is not None and req.top_n < 0:
            raise bad_request(f"top_n={req.top_n} is invalid: must be >= 0 (0: every document)", param="top_n")
        scores, outs = await self._scores(http, [(req.query, d) for d in req.documents], req.truncate_prompt_tokens,
                                          model)
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:req.top_n or None]
        results = [RerankResult(i, scores[i], RerankDocument(req.documents[i]) if req.return_documents else None)
                   for i in order]
        usage = _usage(outs)
        return _json(RerankResponse(random_id("rerank-"), model, RerankUsage(usage.total_tokens,
                                                                             usage.prompt_tokens), results))

    # ---- shared ----
    def _check(self, model: str | None, task: str, route: str) -> str:
        name = self.serving.check_model(model)
        try:
            check_pooling_task(self.model_config, task, route)
        except WrongRunnerError as e:
            raise bad_request(str(e), code="wrong_runner") from None
        return name

    def _params(self, task: str, **fields) -> PoolingParams:
        try:
            return pooling_params_for(self.model_config, PoolingParams(**fields), task)
        except ValueError as e:
            message = str(e).removeprefix("PoolingParams.")
            param = next((name for name in fields if message.startswith(f"{name}=")), None)
            raise bad_request(message, param=param) from None

    def _inputs(self, value, param: str, prefix: str, add_special_tokens: bool = True) -> list[list[int]]:
        """A string, token ids, or a list of either -> token id lists (texts after the model's default prompt)."""
        s = self.serving
        def ids(text: str) -> list[int]:
            return s.tokenizer.encode(prefix + text, add_special_tokens=add_special_tokens)
        if isinstance(value, str):
            return [ids(value)]
        if not value:
            raise bad_request(f"{param} is empty", param=param)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [s.check_token_ids(value, param)]
        out = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                out.append(ids(item))
            elif isinstance(item, list) and item:
                out.append(s.check_token_ids(item, f"{param}[{i}]"))
            else:
                raise bad_request(f"{param} must be a string, a list of token ids, or a list of strings or of token "
                                  "id lists", param=param)
        return out

    @staticmethod
    def _texts(value, param: str) -> list:
        items = [value] if isinstance(value, str) else list(value)
        if not items or not all(isinstance(t, str) for t in items):
            raise bad_request(f"{param} must be a string or a non-empty list of strings", param=param)
        return items

    async def _run(self, http: HTTPRequest, prompts: list[list[int]], params: PoolingParams, param: str,
                   prefix: str, model: str) -> list[PoolingRequestOutput]:
        """Each prompt pooled, with the adapter `model` names (if it names one)."""
        max_len = self.serving.max_model_len
        requests = []
        for i, ids in enumerate(prompts):
            try:
                requests.append((fit_prompt(ids, params, max_len), params))
            except ValueError as e:
                where = param if len(prompts) == 1 else f"{param}[{i}]"
                raise bad_request(f"{where}: {e}", param=param, code="context_length_exceeded") from None
        return await self.serving.run_to_end(http, requests, random_id(prefix),
                                             lora_request=self.serving.lora_request(model))

    async def _scores(self, http: HTTPRequest, pairs: list[tuple[str, str]], truncate: int | None, model: str
                      ) -> tuple[list[float], list[PoolingRequestOutput]]:
        """A cross-encoder scores each pair together; an embedding model by the cosine of the two embeddings."""
        if self.model_config.is_cross_encoder:
            params = self._params("score", truncate_prompt_tokens=truncate)
            tokenizer = self.serving.tokenizer
            outs = await self._run(http, [pair_token_ids(tokenizer, a, b) for a, b in pairs], params, "text_2",
                                   "score-", model)
            return [float(o.outputs.data.item()) for o in outs], outs
        params = self._params("embed", truncate_prompt_tokens=truncate)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each text embedded once
        outs = await self._run(http, self._inputs(texts, "text_1", self.embed_prompt), params, "text_2", "score-",
                               model)
        emb = {t: o.outputs.data for t, o in zip(texts, outs)}
        scores = [F.cosine_similarity(emb[a], emb[b], dim=0).item() for a, b in pairs]
        return scores, outs


def _encode_embedding(data: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return data.tolist()
    return base64.b64encode(data.numpy().astype("<f4").tobytes()).decode()


def _usage(outs: list[PoolingRequestOutput]) -> UsageInfo:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return UsageInfo(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens)
