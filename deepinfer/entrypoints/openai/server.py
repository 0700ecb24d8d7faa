"""The OpenAI-compatible HTTP server: `build_app(engine)` and `run_server(args)`.

    python -m deepinfer.entrypoints.openai.server MODEL_PATH --port 8000
    deepinfer serve MODEL_PATH --port 8000          (the CLI calls run_server)

FastAPI handles routing and validation; one AsyncEngine thread drives the
engine for all requests. A pure-ASGI guard in front of the app gives each
request its id (X-Request-Id, request_context.py), enforces the API key and the
body-size limit before any body is parsed, counts every response by status for
/metrics (the soak test reads the 5xx count there), answers an unexpected
exception with a 500 body (no traceback to the client) and writes the access log.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import logging
import signal
import socket
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import deepinfer
from deepinfer import envs
from deepinfer.entrypoints.openai.async_engine import AsyncEngine
from deepinfer.entrypoints.openai.errors import OpenAIError, install_error_handlers, internal_error
from deepinfer.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
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
from deepinfer.errors import ConfigError, DeepInferError

logger = logging.getLogger("deepinfer.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_ENDPOINTS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/version", "/metrics"}


def check_api_key(api_key: str | None) -> str | None:
    """An API key must be visible ASCII: a header cannot carry anything else, so no client could send it."""
    if api_key is not None and (not api_key or not all("\x21" <= c <= "\x7e" for c in api_key)):
        raise ConfigError("the API key (--api-key / DEEPINFER_API_KEY) must be non-empty visible ASCII (no spaces)")
    return api_key


class _Guard:
    """ASGI middleware: request id + access log, API key on /v1/*, body-size limit (413), response
    counting by status, a 500 body for anything unexpected."""

    def __init__(self, app, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int, access_log: bool = True):
        self.app = app
        self.metrics = metrics
        self.api_key = check_api_key(api_key)
        self._key = api_key.encode("ascii") if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.access_log = access_log

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

        async def counted_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                ctx.status = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, id_header]}
            await send(message)

        async def answer(err: OpenAIError):
            await err.response()(scope, receive, counted_send)

        try:
            if self.api_key is not None and path.startswith("/v1") and not self._authorized(scope):
                return await answer(
                    OpenAIError(401, "Missing or invalid API key (send 'Authorization: Bearer <key>')",
                                "authentication_error", None, "invalid_api_key")
                )
            replay = await self._read_body(scope, receive)
            if replay is None:
                return await answer(
                    OpenAIError(413, f"request body exceeds {self.max_body_bytes} bytes", "invalid_request_error",
                                "body", "request_too_large")
                )
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
        """Buffer the body up to the limit; a receive() that replays it, or None when it is too large."""
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                return None
        if scope.get("method") in ("GET", "HEAD"):
            return receive
        chunks, size = [], 0
        while True:
            message = await receive()
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


def build_app(
    engine,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_path: str | None = None,
    limits: ServerLimits | None = None,
    access_log: bool = True,
) -> FastAPI:
    """A FastAPI app serving `engine` (a DeepInferenceEngine); the engine loop runs during the app's lifespan.

    `limits`: the per-request work caps (default ServerLimits()); `access_log`: one info line per
    request on the "deepinfer.access" logger."""
    install_log_record_factory()
    check_api_key(api_key)
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
    completions, chat = CompletionsHandler(state), ChatHandler(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="DeepInfer", version=deepinfer.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.deepinfer = state
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        if not async_engine.running:
            return JSONResponse({"status": "unhealthy", "reason": repr(async_engine.dead)}, status_code=503)
        return {"status": "draining" if async_engine.draining else "ok"}

    @app.get("/version")
    async def version():
        return {"version": deepinfer.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=n, root=state.model_path, max_model_len=state.max_model_len) for n in names]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request):
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        return await chat.create(body, raw)

    app.add_middleware(_Guard, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes, access_log=access_log)
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


# ---------------------------------------------------------------- command line


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `serve` flags; defined once in the CLI (FastAPI-free) and reused here."""
    from deepinfer.entrypoints.cli_serve import add_serve_arguments as add

    return add(parser)


def run_server(args: argparse.Namespace) -> int:
    """Load the engine, print what was loaded and where, serve until SIGTERM / SIGINT, drain, exit 0."""
    import uvicorn

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
    async_engine = state.async_engine

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # first signal: stop taking requests, let in-flight ones finish
            if not async_engine.draining:
                async_engine.draining = True
                print(f"signal {sig}: draining {async_engine.num_in_flight} in-flight requests, then exiting", flush=True)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after shutdown (exit status -15); a drained server exits 0 instead.
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,  # the guard writes its own access line (with tokens and TTFT); --no-access-log
        timeout_graceful_shutdown=getattr(args, "drain_timeout", None),
        lifespan="on",
    )
    _Server(config).run(sockets=[sock])
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
