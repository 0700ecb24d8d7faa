"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}.

Every failure the server reports goes through `OpenAIError`, so clients (the
official `openai` package included) see the status codes and body shape they
already handle, and no traceback ever reaches a client.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.errors import InvalidRequestError

logger = logging.getLogger("deepinfer.server")


class OpenAIError(Exception):
    """An error answered as an OpenAI error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return _ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class _ErrorResponse(JSONResponse):
    """Error bodies are written with ASCII escapes: a message quoting client input can never fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def from_invalid_request(exc: InvalidRequestError, rename: dict[str, str] | None = None) -> OpenAIError:
    """An engine-side InvalidRequestError (SamplingParams, prompt checks) as a 400 naming its field."""
    param = exc.param
    message = str(exc)
    if rename and param in rename:
        message = message.replace(param, rename[param], 1) if message.startswith(param) else message
        param = rename[param]
    return bad_request(message, param)


def overloaded(message: str, retry_after_s: int = 1) -> OpenAIError:
    return OpenAIError(
        503, message, "service_unavailable_error", None, "server_overloaded", {"Retry-After": str(retry_after_s)}
    )


def request_timeout(message: str) -> OpenAIError:
    """408: the client did not send its request (headers or body) in time; the connection closes."""
    return OpenAIError(408, message, "invalid_request_error", None, "request_timeout", {"Connection": "close"})


def headers_too_large(message: str) -> OpenAIError:
    """431: too many request headers, or too many bytes of them; the connection closes."""
    return OpenAIError(431, message, "invalid_request_error", "headers", "request_header_fields_too_large",
                       {"Connection": "close"})


def internal_error(message: str = "internal server error") -> OpenAIError:
    return OpenAIError(500, message, "server_error", None, "internal_error")


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """Pydantic errors -> 400 naming the first bad field (FastAPI's default would be 422)."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body", "body")
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") in ("json_invalid", "json_type"):
        return bad_request(f"request body is not valid JSON: {err.get('msg', '')}", "body", "invalid_json")
    # Union members show up in loc as type names ("list[int]"); keep only the field path.
    path = []
    for p in loc:
        if isinstance(p, int):
            path.append(f"[{p}]")
        elif "[" in p or p in ("str", "int", "float", "bool", "none", "function-after", "function-before"):
            continue
        else:
            path.append(("." if path else "") + p)
    field = "".join(path) or "body"
    param = next((p for p in loc if isinstance(p, str)), "body")
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        return bad_request(f"{field} is required", param, "missing_required_parameter")
    return bad_request(f"{field}: {msg}", param)


def _allowed_methods(request: Request) -> list[str]:
    from starlette.routing import Match

    allowed: set[str] = set()
    for route in request.app.router.routes:
        methods = getattr(route, "methods", None)
        if methods and route.matches(request.scope)[0] is not Match.NONE:
            allowed |= set(methods)
    order = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return sorted(allowed, key=lambda m: (order.index(m) if m in order else len(order), m))


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception to an OpenAI error body; unexpected ones become a 500 without details."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        return from_invalid_request(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # FastAPI could not parse the body (e.g. it is not UTF-8)
            return bad_request(f"request body is not valid JSON text: {exc.detail}", "body", "invalid_json").response()
        codes = {404: "not_found", 405: "method_not_allowed"}
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # RFC 9110: a 405 lists the methods the resource has. Starlette's names those of the first
            # route of the path only (a GET route and its HEAD twin are two routes): ask all of them.
            headers["Allow"] = ", ".join(_allowed_methods(request) or [headers.get("Allow", "")])
        err = OpenAIError(exc.status_code, str(exc.detail), "invalid_request_error", None, codes.get(exc.status_code),
                          headers)
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error().response()
