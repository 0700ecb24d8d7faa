"""The OpenAI-compatible HTTP server: `build_app(engine)` and `run_server(args)`.

    python -m deepinfer.entrypoints.openai.server MODEL_PATH --port 8000
    deepinfer serve MODEL_PATH --port 8000          (the CLI calls run_server)

FastAPI handles routing and validation; one AsyncEngine thread drives the
engine for all requests. A pure-ASGI guard in front of the app gives each
request its id (X-Request-Id, request_context.py), enforces the header caps
(431), the connection cap (503), the API key, the body-size limit (413) and the
body read timeout (408) before any body is parsed, answers new generation
requests 503 while draining, counts every response by status for /metrics (the
soak test reads the 5xx count there), answers an unexpected exception with a 500
body (no traceback to the client) and writes the access log. The header read
timeout lives in the HTTP protocol class (http_protocol.py); /openapi.json is
contract.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Annotated, Any, Callable

import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response

import deepinfer
from deepinfer import envs
from deepinfer.entrypoints.openai import contract
from deepinfer.entrypoints.openai.async_engine import AsyncEngine
from deepinfer.entrypoints.openai.errors import (
    OpenAIError,
    headers_too_large,
    install_error_handlers,
    internal_error,
    overloaded,
    request_timeout,
)
from deepinfer.entrypoints.openai.http_protocol import OVER_CAPACITY, ConnectionLimits, protocol_class
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
from deepinfer.entrypoints.openai.request_checks import ServerLimits
from deepinfer.entrypoints.openai.request_context import (
    LOG_FORMAT,
    REQUEST_ID_HEADER,
    RequestContext,
    current,
    install_log_record_factory,
    log_access,
    request_id_from_scope,
)
from deepinfer.entrypoints.openai.serving_chat import ChatHandler
from deepinfer.entrypoints.openai.serving_common import ServerState
from deepinfer.entrypoints.openai.serving_completions import CompletionsHandler
from deepinfer.entrypoints.openai.serving_tokenize import TokenizeHandler
from deepinfer.errors import ConfigError, DeepInferError

logger = logging.getLogger("deepinfer.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_ENDPOINTS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/version", "/metrics",
              "/tokenize", "/detokenize"}
_AUTH_PATHS = ("/tokenize", "/detokenize")  # besides /v1/*
_GENERATION = {"/v1/completions", "/v1/chat/completions"}  # refused (503) while draining
DRAIN_RETRY_AFTER_S = 5
_CLOSE = (b"connection", b"close")


def check_api_key(api_key: str | None) -> str | None:
    """An API key must be visible ASCII: a header cannot carry anything else, so no client could send it."""
    if api_key is not None and (not api_key or not all("\x21" <= c <= "\x7e" for c in api_key)):
        raise ConfigError("the API key (--api-key / DEEPINFER_API_KEY) must be non-empty visible ASCII (no spaces)")
    return api_key


class _Guard:
    """ASGI middleware: request id + access log, header caps (431), connection cap (503), API key on
    /v1/*, /tokenize and /detokenize (401), body-size limit (413), body read timeout (408), 503 for
    new generation requests while draining, response counting by status, a 500 body for anything
    unexpected. While draining, and beyond the connection cap, responses close their connection."""

    def __init__(self, app, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int, access_log: bool = True,
                 limits: ConnectionLimits | None = None, draining: Callable[[], bool] = lambda: False):
        self.app = app
        self.metrics = metrics
        self.api_key = check_api_key(api_key)
        self._key = api_key.encode("ascii") if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.access_log = access_log
        self.limits = limits or ConnectionLimits()
        self.draining = draining

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"
        client = scope.get("client")
        ctx = RequestContext(
            request_id=request_id_from_scope(scope),
            method=scope.get("method", ""),
            path=path,
            client=f"{client[0]}:{client[1]}" if client else "-",
        )
        token = current.set(ctx)
        id_header = (REQUEST_ID_HEADER, ctx.request_id.encode("ascii"))
        started = False
        over_capacity = bool(scope.get(OVER_CAPACITY))
        close = over_capacity or self.draining()

        async def counted_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                ctx.status = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != REQUEST_ID_HEADER]
                if close and _CLOSE not in headers:
                    headers.append(_CLOSE)
                message = {**message, "headers": [*headers, id_header]}
            await send(message)

        async def answer(err: OpenAIError):
            await err.response()(scope, receive, counted_send)

        try:
            headers = scope.get("headers", [])
            if len(headers) > self.limits.max_header_count:
                return await answer(headers_too_large(
                    f"the request has {len(headers)} headers; the server allows at most "
                    f"{self.limits.max_header_count}"))
            header_bytes = sum(len(name) + len(value) + 4 for name, value in headers)  # "name: value\r\n"
            if header_bytes > self.limits.max_header_bytes:
                return await answer(headers_too_large(
                    f"the request headers hold {header_bytes} bytes; the server allows at most "
                    f"{self.limits.max_header_bytes}"))
            if over_capacity and path != "/health":  # probes of a saturated server still succeed
                return await answer(overloaded(
                    f"the server is at its connection limit ({self.limits.max_connections}); retry later"))
            if self.api_key is not None and (path.startswith("/v1") or path in _AUTH_PATHS) \
                    and not self._authorized(scope):
                return await answer(
                    OpenAIError(401, "Missing or invalid API key (send 'Authorization: Bearer <key>')",
                                "authentication_error", None, "invalid_api_key")
                )
            if self.draining() and path in _GENERATION:
                return await answer(overloaded("the server is shutting down", retry_after_s=DRAIN_RETRY_AFTER_S))
            replay = await self._read_body(scope, receive)
            if replay is None:
                return await answer(
                    OpenAIError(413, f"request body exceeds {self.max_body_bytes} bytes", "invalid_request_error",
                                "body", "request_too_large")
                )
            if replay is _TIMED_OUT:
                return await answer(request_timeout(
                    f"the request body did not arrive within {self.limits.body_timeout:g} s"))
            await self.app(scope, replay, counted_send)
        except Exception:
            # Whatever escaped the app's handlers: logged here with the request id, a plain 500 to the client.
            logger.exception("unhandled error on %s %s", ctx.method, path)
            if not started:
                await answer(internal_error())
            else:
                ctx.status = 500
        finally:
            self.metrics.on_response(endpoint, ctx.status if ctx.status is not None else 499)
            if self.access_log:
                log_access(ctx)
            current.reset(token)

    def _authorized(self, scope) -> bool:
        """Exactly one `Authorization: Bearer <key>` header, ASCII; anything else (non-ASCII bytes, no
        scheme, another scheme, several headers) is simply not authorized: a 401, never an error."""
        values = [value for name, value in scope.get("headers", []) if name == b"authorization"]
        if len(values) != 1:
            return False
        scheme, sep, token = values[0].strip().partition(b" ")
        if not sep or scheme.lower() != b"bearer" or not token.strip().isascii():
            return False
        return hmac.compare_digest(token.strip(), self._key)

    async def _read_body(self, scope, receive):
        """Buffer the body up to the limit; a receive() that replays it, None when it is too large, or
        _TIMED_OUT when all of it did not arrive within the body timeout (counted from the headers)."""
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                return None
        if scope.get("method") in ("GET", "HEAD"):
            return receive
        timeout = self.limits.body_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks, size = [], 0
        while True:
            try:
                if deadline is None:
                    message = await receive()
                else:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return _TIMED_OUT
            if message["type"] != "http.request":
                return receive  # disconnected mid-body; let the app see it
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return replay


_TIMED_OUT = object()


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
) -> FastAPI:
    """A FastAPI app serving `engine` (a DeepInferenceEngine); the engine loop runs during the app's lifespan.

    `limits`: the per-request work caps (default ServerLimits()); `access_log`: one info line per
    request on the "deepinfer.access" logger; `connection_limits`: the header caps and body timeout
    the app enforces itself (the header timeout and the connection cap need `uvicorn_config`'s
    protocol class too)."""
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
    app.add_middleware(_Guard, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes, access_log=access_log,
                       limits=connection_limits, draining=lambda: async_engine.draining)
    return app


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """The `serve` flags' work caps (cli_serve.py); a flag left unset keeps ServerLimits' default."""
    defaults = ServerLimits()
    kwargs = {}
    for name in ("max_choices_per_request", "max_stop_strings", "max_stop_chars", "max_logprobs", "max_output_tokens"):
        value = getattr(args, name, None)
        kwargs[name] = getattr(defaults, name) if value is None else value
    try:
        return ServerLimits(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"--{str(exc).replace('_', '-')}") from None


_CONNECTION_FLAGS = {  # ConnectionLimits field -> flag (cli_serve.py); a value of 0 turns a timeout / cap off
    "header_timeout": "header-timeout",
    "body_timeout": "body-timeout",
    "keep_alive_timeout": "keep-alive-timeout",
    "max_header_count": "max-header-count",
    "max_header_bytes": "max-header-bytes",
    "max_connections": "max-connections",
}


def connection_limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    """The `serve` flags' connection limits; unset flags keep ConnectionLimits' defaults, and 0 turns
    off the header / body timeouts and the connection cap."""
    defaults = ConnectionLimits()
    kwargs = {}
    for name, flag in _CONNECTION_FLAGS.items():
        value = getattr(args, name, None)
        if value is None:
            value = getattr(defaults, name)
        elif value == 0 and name in ("header_timeout", "body_timeout", "max_connections"):
            value = None
        kwargs[name] = value
    try:
        return ConnectionLimits(**kwargs)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise ConfigError(f"--{_CONNECTION_FLAGS.get(name, name)}{str(exc)[len(name):]}") from None


def uvicorn_config(app: FastAPI, limits: ConnectionLimits, log_level: str = "info",
                   drain_timeout: float | None = None):
    """The uvicorn.Config `deepinfer serve` runs `app` with: its own h11 protocol class (header timeout,
    431, connection cap: http_protocol.py), uvicorn's keep-alive timeout, no uvicorn access log (the
    guard writes its own line) and no WebSocket upgrades."""
    metrics: ServerMetrics = app.state.metrics
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,  # the guard writes its own access line (with tokens and TTFT); --no-access-log
        timeout_graceful_shutdown=drain_timeout,
        lifespan="on",
        http=protocol_class(limits, on_reject=lambda status: metrics.on_response("other", status)),
        ws="none",
        timeout_keep_alive=limits.keep_alive_timeout,
        h11_max_incomplete_event_size=limits.max_head_bytes,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn.Server with DeepInfer's shutdown (docs/serving.md, "Draining").

    The first SIGTERM / SIGINT (or `begin_drain()`) starts draining: the listening socket stays
    open, /health answers 503 `draining`, new generation requests get 503 + Retry-After, and
    every response closes its connection, while the requests in flight run to their end. Once
    the engine has none left (or `drain_timeout` seconds have passed), uvicorn's graceful
    shutdown closes the socket, waits for the responses still being written (within what is left
    of `drain_timeout`) and stops the engine loop; the process then exits 0. A second signal
    exits at once (the requests still running are aborted).
    """

    def __init__(self, config, async_engine: AsyncEngine, drain_timeout: float | None = None):
        super().__init__(config)
        self.async_engine = async_engine
        self.drain_timeout = drain_timeout
        self.drain_started: float | None = None

    def begin_drain(self, reason: str = "drain requested") -> None:
        if self.drain_started is None:
            self.drain_started = time.monotonic()
            self.async_engine.draining = True
            print(f"{reason}: draining {self.async_engine.num_in_flight} in-flight requests, then exiting",
                  flush=True)

    def handle_exit(self, sig, frame):
        if self.drain_started is None:
            self.begin_drain(f"signal {sig}")
            return
        print(f"signal {sig} while draining: exiting now", flush=True)
        self.should_exit = True
        self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            elapsed = time.monotonic() - self.drain_started
            timeout = self.drain_timeout
            if self.async_engine.num_in_flight == 0 or (timeout is not None and elapsed >= timeout):
                if timeout is not None:  # what is left of the drain for uvicorn's own wait
                    self.config.timeout_graceful_shutdown = max(1.0, timeout - elapsed)
                self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises the signal after shutdown (exit status -15); a drained server exits 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# ---------------------------------------------------------------- command line


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `serve` flags; defined once in the CLI (FastAPI-free) and reused here."""
    from deepinfer.entrypoints.cli_serve import add_serve_arguments as add

    return add(parser)


def run_server(args: argparse.Namespace) -> int:
    """Load the engine, print what was loaded and where, serve until SIGTERM / SIGINT, drain, exit 0."""
    from deepinfer.engine import DeepInferenceEngine
    from deepinfer.entrypoints.cli_args import engine_config_from_args

    log_level = getattr(args, "log_level", "info")
    install_log_record_factory()
    handler = logging.StreamHandler()
    # defaults: a record made without the factory (LogRecord(...) directly) still formats
    handler.setFormatter(logging.Formatter(LOG_FORMAT, defaults={"request_tag": "", "request_id": None}))
    logging.basicConfig(level=log_level.upper(), handlers=[handler])
    api_key = check_api_key(getattr(args, "api_key", None) or envs.API_KEY.get() or None)
    limits = limits_from_args(args)
    connection_limits = connection_limits_from_args(args)
    host, port = getattr(args, "host", "127.0.0.1"), getattr(args, "port", 8000)

    engine = DeepInferenceEngine.from_config(engine_config_from_args(args))
    app = build_app(
        engine,
        served_model_name=getattr(args, "served_model_name", None),
        api_key=api_key,
        max_waiting_requests=getattr(args, "max_waiting_requests", None),
        max_body_bytes=getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES,
        model_path=args.model,
        limits=limits,
        access_log=not getattr(args, "no_access_log", False),
        connection_limits=connection_limits,
    )
    state: ServerState = app.state.deepinfer
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so; without it every
    # keep-alive response (headers and body are separate writes) and SSE chunk waits ~40 ms on Nagle
    # + delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections made right after the URL is printed wait in the backlog, not refused
    port = sock.getsockname()[1]
    url = f"http://{'[' + host + ']' if family == socket.AF_INET6 else host}:{port}"
    stats = engine.stats()
    print(
        f"DeepInfer {deepinfer.__version__}: loaded {args.model} as {state.served_model_names[0]!r}\n"
        f"  backend: {engine.backend_name}   max_model_len: {engine.max_model_len}\n"
        f"  KV cache: {stats.kv_capacity_tokens} tokens ({stats.kv_blocks_total} blocks)\n"
        f"  API key: {'required' if api_key else 'none'}\n"
        f"  serving on {url}  (OpenAI API at {url}/v1)",
        flush=True,
    )
    config = uvicorn_config(app, connection_limits, log_level=log_level,
                            drain_timeout=getattr(args, "drain_timeout", None))
    DrainingServer(config, state.async_engine, getattr(args, "drain_timeout", None)).run(sockets=[sock])
    print("server stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_serve_arguments(argparse.ArgumentParser(prog="deepinfer-serve", description=__doc__.splitlines()[0]))
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        return run_server(args)
    except DeepInferError as exc:
        from deepinfer.entrypoints.cli_args import user_message

        print(f"error: {user_message(exc, args, argv)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
