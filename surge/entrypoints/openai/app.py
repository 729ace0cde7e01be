"""The ASGI app (starlette, msgspec JSON) and `run_server`, which starts the engine, then uvicorn (uvloop,
httptools). Every error is answered in OpenAI's shape; none of them stops the server.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from surge.engine.args import EngineArgs
from surge.engine.async_llm import AsyncLLM
from surge.entrypoints.openai.chat import ChatHandler
from surge.entrypoints.openai.completions import CompletionsHandler
from surge.entrypoints.openai.errors import APIError
from surge.entrypoints.openai.guard import ApiKeyMiddleware, InternalErrorMiddleware, error_response, read_json
from surge.entrypoints.openai.lora import LoRAHandler, LoRAModulePath
from surge.engine.pooling import WrongRunnerError, check_generation
from surge.entrypoints.openai.metrics import PrometheusMetrics, check_metrics_prefix
from surge.entrypoints.openai.pooling import PoolingHandler
from surge.entrypoints.openai.pooling_protocol import (ClassificationRequest, EmbeddingRequest, RerankRequest,
                                                       ScoreRequest)
from surge.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                               DetokenizeResponse, ModelCard, ModelList, ResponsesRequest,
                                               TokenizeRequest, TokenizeResponse)
from surge.entrypoints.openai.responses import ResponsesHandler
from surge.entrypoints.openai.options import ServerOptions
from surge.entrypoints.openai.serving import ClientDisconnected, OpenAIServing, encode
from surge.logger import init_logger
from surge.version import __version__

logger = init_logger(__name__)


def _json(obj, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type="application/json")


_error = error_response


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              metrics: PrometheusMetrics | None = None, options: ServerOptions | None = None,
              lora_modules: list[LoRAModulePath] | None = None) -> Starlette:
    options = options or ServerOptions()
    serving = OpenAIServing(engine, served_model_names, options)
    loras = LoRAHandler(serving, served_model_names[0])
    for module in lora_modules or []:
        loras.add(module.name, module.path, module.base_model_name)
    limits = options.limits
    completions, chat, responses = CompletionsHandler(serving), ChatHandler(serving), ResponsesHandler(serving)
    pooling = PoolingHandler(serving)
    created = int(time.time())

    def endpoint(create, request_type, generates: bool = False):
        """create(body, request): a handler's; generates: a generation route, which a pooling model refuses."""
        async def route(request: Request) -> Response:
            if generates:
                try:
                    check_generation(engine.config.model_config, request.url.path)
                except WrongRunnerError as e:
                    raise APIError(400, str(e), code="wrong_runner") from None
            body = await read_json(request, limits, request_type)
            try:
                return await create(body, request)
            except ClientDisconnected:
                return Response(status_code=499)  # nobody is listening; the requests were aborted
        return route

    async def health(request: Request) -> Response:
        if engine.dead_error is not None or not engine.is_running:
            return _error(APIError(503, str(engine.dead_error or "the engine core is not running"),
                                   code="engine_dead"))
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return _json({"version": __version__})

    def card(name: str) -> ModelCard:
        lora = serving.loras.get(name)
        if lora is not None:  # as vLLM lists an adapter: its path as root, the base model as parent
            return ModelCard(name, created, serving.max_model_len, lora.lora_path,
                             parent=lora.base_model_name or served_model_names[0])
        return ModelCard(name, created, serving.max_model_len, engine.config.model_config.model)

    async def models(request: Request) -> Response:
        return _json(ModelList([card(name) for name in [*served_model_names, *serving.loras]]))

    async def model(request: Request) -> Response:
        name = request.path_params["model"]  # may hold slashes: org/model
        serving.check_model(name)
        return _json(card(name))

    async def tokenize(request: Request) -> Response:
        req = await read_json(request, limits, TokenizeRequest)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            tokens = serving.render(serving.chat_messages(req.messages), req.add_generation_prompt,
                                    req.chat_template_kwargs, req.chat_template)
        else:
            tokens = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return _json(TokenizeResponse(tokens, len(tokens), serving.max_model_len))

    async def detokenize(request: Request) -> Response:
        req = await read_json(request, limits, DetokenizeRequest)
        serving.check_model(req.model)
        tokens = serving.check_token_ids(req.tokens, "tokens")
        return _json(DetokenizeResponse(serving.tokenizer.decode(tokens)))

    async def prometheus(request: Request) -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def api_error(request: Request, e: APIError) -> Response:
        return _error(e)

    async def http_error(request: Request, e: HTTPException) -> Response:
        return _error(APIError(e.status_code, e.detail or "error", code="not_found" if e.status_code == 404 else None))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await engine.shutdown()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/v1/completions", endpoint(completions.create, CompletionRequest, True), methods=["POST"]),
            Route("/v1/chat/completions", endpoint(chat.create, ChatCompletionRequest, True), methods=["POST"]),
            Route("/v1/responses", endpoint(responses.create, ResponsesRequest, True), methods=["POST"]),
            Route("/v1/embeddings", endpoint(pooling.embeddings, EmbeddingRequest), methods=["POST"]),
            *(Route(path, endpoint(pooling.score, ScoreRequest), methods=["POST"]) for path in ("/score", "/v1/score")),
            *(Route(path, endpoint(pooling.rerank, RerankRequest), methods=["POST"])
              for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
            *(Route(path, endpoint(pooling.classify, ClassificationRequest), methods=["POST"])
              for path in ("/classify", "/v1/classify")),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/v1/load_lora_adapter", loras.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", loras.unload, methods=["POST"]),
        ],
        # Anything else is InternalErrorMiddleware's: a handler for Exception would be Starlette's outermost
        # middleware, which re-raises after answering and so drops the client's keep-alive connection.
        exception_handlers={APIError: api_error, HTTPException: http_error},
        lifespan=lifespan,
    )
    app.add_middleware(InternalErrorMiddleware)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.state.serving = serving
    return app


def run_server(engine_args: EngineArgs, host: str, port: int, api_key: str | None, served_model_names: list[str] | None,
               log_level: str = "info", access_log: bool = True, metrics_prefix: str = "surge",
               options: ServerOptions | None = None, lora_modules: list[LoRAModulePath] | None = None) -> None:
    import uvicorn

    check_metrics_prefix(metrics_prefix)
    config = engine_args.create_engine_config()
    # Named as the user gave the model; the default model by its directory name rather than a cache path.
    names = served_model_names or [str(engine_args.model or Path(config.model_config.model).name)]
    engine = AsyncLLM(config)
    try:
        metrics = PrometheusMetrics(names[0], config, engine.core.ready.num_kv_blocks, metrics_prefix)
        engine.stats_observers.append(metrics)
        app = build_app(engine, names, api_key, metrics, options, lora_modules)
        logger.info("serving %s as %s on http://%s:%d", config.model_config.model, ", ".join(names), host, port)
        uvicorn.run(app, host=host, port=port, loop="uvloop", http="httptools", log_level=log_level,
                    access_log=access_log, timeout_graceful_shutdown=5)
    finally:
        engine.core.shutdown()

