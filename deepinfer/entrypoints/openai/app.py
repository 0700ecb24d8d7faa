"""`build_app(engine)`: the FastAPI app of the OpenAI-compatible server, its routes and its lifespan.

FastAPI handles routing and validation; one AsyncEngine thread drives the engine for all requests;
the guard (guard.py) sits in front; /openapi.json is contract.py's. The process around the app
(flags, uvicorn, signals, draining) is server.py's.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response

import deepinfer
from deepinfer.entrypoints.openai import contract
from deepinfer.entrypoints.openai.async_engine import AsyncEngine
from deepinfer.entrypoints.openai.errors import (
    OpenAIError,
    install_error_handlers,
)
from deepinfer.entrypoints.openai.guard import DEFAULT_MAX_BODY_BYTES, DRAIN_RETRY_AFTER_S, RequestGuard, check_api_key
from deepinfer.entrypoints.openai.http_protocol import ConnectionLimits
from deepinfer.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from deepinfer.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeResponse,
    HealthStatus,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionInfo,
)
from deepinfer.entrypoints.openai.reasoning_parser import REASONING_PARSERS
from deepinfer.entrypoints.openai.request_checks import ServerLimits
from deepinfer.entrypoints.openai.request_context import (
    install_log_record_factory,
)
from deepinfer.entrypoints.openai.serving_chat import ChatHandler
from deepinfer.entrypoints.openai.serving_common import ServerState
from deepinfer.entrypoints.openai.serving_completions import CompletionsHandler
from deepinfer.entrypoints.openai.serving_tokenize import TokenizeHandler
from deepinfer.errors import ConfigError

logger = logging.getLogger("deepinfer.server")


def build_app(
    engine,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_path: str | None = None,
    limits: ServerLimits | None = None,
    access_log: bool = True,
    connection_limits: ConnectionLimits | None = None,
    reasoning_parser: str | None = None,
    json_whitespace: str = "flexible",
) -> FastAPI:
    """A FastAPI app serving `engine` (a DeepInferenceEngine); the engine loop runs during the app's lifespan.

    `limits`: the per-request work caps (default ServerLimits()); `access_log`: one info line per
    request on the "deepinfer.access" logger; `connection_limits`: the header caps and body timeout
    the app enforces itself (the header timeout and the connection cap need `uvicorn_config`'s
    protocol class too); `reasoning_parser`: "deepseek_r1" splits `<think>...</think>` into
    `reasoning_content` on /v1/chat/completions (a constraint then applies after the reasoning);
    `json_whitespace`: "flexible" (any JSON whitespace) or "compact" for JSON constraints whose request
    does not choose (structured_outputs.disable_any_whitespace)."""
    if json_whitespace not in ("flexible", "compact"):
        raise ConfigError(f"json_whitespace must be 'flexible' or 'compact' (got {json_whitespace!r})")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ConfigError(f"reasoning_parser must be one of {list(REASONING_PARSERS)} (got {reasoning_parser!r})")
    install_log_record_factory()
    check_api_key(api_key)
    connection_limits = connection_limits or ConnectionLimits()
    metrics = ServerMetrics()
    if max_waiting_requests is None:
        max_waiting_requests = getattr(getattr(engine, "config", None), "max_waiting_requests", None)
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests, metrics=metrics)
    metrics.attach(async_engine)
    names = served_model_name if isinstance(served_model_name, list) else [served_model_name or engine.model_name]
    state = ServerState(
        async_engine=async_engine,
        tokenizer=engine.tokenizer,
        served_model_names=names,
        max_model_len=engine.max_model_len,
        model_path=model_path or getattr(getattr(engine, "config", None), "model_name_or_path", None),
        limits=limits or ServerLimits(),
        reasoning_parser=reasoning_parser,
        json_whitespace=json_whitespace,
        structured_backend=getattr(getattr(engine, "config", None), "structured_output_backend", "llguidance"),
    )
    completions, chat, tokenize = CompletionsHandler(state), ChatHandler(state), TokenizeHandler(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="DeepInfer", version=deepinfer.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="DeepInfer's OpenAI-compatible server (docs/serving.md). Errors are "
                              '`{"error": {"message", "type", "param", "code"}}`.')
    app.state.deepinfer = state
    app.state.metrics = metrics
    install_error_handlers(app)
    keyed = api_key is not None

    def get(path: str, **kwargs):
        """A GET route and its HEAD twin (the same status and headers, no body): FastAPI adds no HEAD
        itself, and one route with both methods would give both operations one operationId."""

        def register(fn):
            app.add_api_route(path, fn, methods=["GET"], **kwargs)
            app.add_api_route(path, fn, methods=["HEAD"], **kwargs)
            return fn

        return register

    def cards() -> list[ModelCard]:
        return [ModelCard(id=n, root=state.model_path, max_model_len=state.max_model_len) for n in names]

    @get("/health", response_model=None, responses={
        200: {"model": HealthStatus, "description": '`{"status": "ok"}`'},
        503: {"model": HealthStatus, "description": '`{"status": "draining"}` (SIGTERM: in-flight requests '
                                                    'finish, new ones get 503) or `{"status": "unhealthy"}` (the '
                                                    'engine loop died)'},
        **contract.error_responses(408, 431, 500)})
    async def health():
        if not async_engine.running:
            return JSONResponse({"status": "unhealthy", "reason": repr(async_engine.dead)}, status_code=503)
        if async_engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})
        return {"status": "ok"}

    @get("/version", response_model=None,
                   responses={200: {"model": VersionInfo}, **contract.route_responses("get", False)})
    async def version():
        return {"version": deepinfer.__version__}

    @get("/metrics", response_class=Response, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}},
              "description": "Prometheus' text exposition format"},
        **contract.route_responses("get", False)})
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @get("/v1/models", response_model=None,
                   responses={200: {"model": ModelList}, **contract.route_responses("v1get", keyed)})
    async def models():
        return ModelList(data=cards()).model_dump()

    @get("/v1/models/{model:path}", response_model=None,
                   responses={200: {"model": ModelCard}, **contract.route_responses("v1get_model", keyed)})
    async def model_card(model: str):
        for card in cards():
            if card.id == model:
                return card.model_dump()
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves {names}",
                          "invalid_request_error", "model", "model_not_found")

    @app.post("/v1/completions", response_model=None, responses={
        200: {"model": CompletionResponse, "content": contract.sse("CompletionChunk")},
        **contract.route_responses("post", keyed)})
    async def create_completion(body: CompletionRequest, raw: Request):
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions", response_model=None, responses={
        200: {"model": ChatCompletionResponse, "content": contract.sse("ChatCompletionChunk")},
        **contract.route_responses("post", keyed)})
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        return await chat.create(body, raw)

    @app.post("/tokenize", response_model=None,
              responses={200: {"model": TokenizeResponse}, **contract.route_responses("post", keyed)})
    async def tokenize_route(body: Annotated[Any, Body()]):
        return await tokenize.tokenize(body)

    @app.post("/detokenize", response_model=None,
              responses={200: {"model": DetokenizeResponse}, **contract.route_responses("post", keyed)})
    async def detokenize_route(body: Annotated[Any, Body()]):
        return await tokenize.detokenize(body)

    tok_vocab = getattr(engine.tokenizer, "vocab_size", None)
    contract.install(app, state, state.limits, keyed, tok_vocab, getattr(engine, "vocab_size", None))
    app.add_middleware(RequestGuard, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes, access_log=access_log,
                       limits=connection_limits, draining=lambda: async_engine.draining)
    return app
