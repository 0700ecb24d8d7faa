"""The ASGI guard in front of the app: what every request passes before FastAPI parses it.

It gives each request its id (X-Request-Id, request_context.py), enforces the header caps (431),
the connection cap (503), the API key (401), the body-size limit (413) and the body read timeout
(408) before any body is parsed, answers new generation requests 503 while draining, counts every
response by status for /metrics (the soak test reads the 5xx count there), answers an unexpected
exception with a 500 body (no traceback to the client) and writes the access log.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Callable

from deepinfer.entrypoints.openai.errors import (
    OpenAIError,
    headers_too_large,
    internal_error,
    overloaded,
    request_timeout,
)
from deepinfer.entrypoints.openai.http_protocol import OVER_CAPACITY, ConnectionLimits
from deepinfer.entrypoints.openai.metrics import ServerMetrics
from deepinfer.entrypoints.openai.request_context import (
    REQUEST_ID_HEADER,
    RequestContext,
    current,
    log_access,
    request_id_from_scope,
)
from deepinfer.errors import ConfigError

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


class RequestGuard:
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
