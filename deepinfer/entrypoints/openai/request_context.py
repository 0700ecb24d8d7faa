"""Per-request context: the request id (X-Request-Id), log records tagged with it, the access log.

The ASGI guard (guard.py) makes one `RequestContext` per HTTP request and sets it in the
`current` context variable for everything that runs on the request's behalf: the handler, the
streaming body, and the tokenizer thread (serving_common.off_loop copies the context). Handlers
fill in the token counts; RequestHandle.outputs (async_engine.py) records the first token; the
guard writes the access-log line when the response is over.

Every log record made while a request's context is current carries `request_id` (a record
factory, so caplog and any handler see it too; None outside a request) and `request_tag`
("[<id>] ", or "" outside a request) for format strings: run_server logs with
"%(asctime)s %(levelname)s %(name)s: %(request_tag)s%(message)s". Lines the engine thread writes
about a request name its engine id (`cmpl-<id>` / `chatcmpl-<id>`) in the message itself.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_LEN = 128
# Visible ASCII only (no space, no control characters): safe in a header, a log line and an id.
_VALID_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,%d}\Z" % MAX_REQUEST_ID_LEN)

access_logger = logging.getLogger("deepinfer.access")


@dataclass
class RequestContext:
    """What the access log reports about one HTTP request (times are time.monotonic())."""

    request_id: str
    method: str = ""
    path: str = ""
    client: str = "-"
    start: float = field(default_factory=time.monotonic)
    status: int | None = None
    prompt_tokens: int | None = None  # set by the completion handlers once the prompt is tokenized
    completion_tokens: int = 0  # summed over the request's engine requests as they end
    first_token: float | None = None

    def on_first_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()

    def access_line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        ttft = f"{self.first_token - self.start:.3f}s" if self.first_token is not None else "-"
        prompt = "-" if self.prompt_tokens is None else str(self.prompt_tokens)
        completion = str(self.completion_tokens) if self.prompt_tokens is not None else "-"
        return (
            f'{self.client} "{self.method} {self.path}" {self.status if self.status is not None else "-"} '
            f"prompt_tokens={prompt} completion_tokens={completion} ttft={ttft} total={now - self.start:.3f}s"
        )


current: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("deepinfer_request", default=None)


def current_request() -> RequestContext | None:
    return current.get()


def new_request_id() -> str:
    return uuid.uuid4().hex


def valid_request_id(value: bytes | str | None) -> str | None:
    """The id a client sent, if it is 1-128 visible ASCII characters; else None (the server makes one)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return value if _VALID_REQUEST_ID.match(value) else None


def request_id_from_scope(scope) -> str:
    """The validated X-Request-Id of an ASGI request, or a new one (the first header counts)."""
    for name, value in scope.get("headers", []):
        if name == REQUEST_ID_HEADER:
            return valid_request_id(value) or new_request_id()
    return new_request_id()


def log_access(ctx: RequestContext) -> None:
    access_logger.info("%s", ctx.access_line())


# ---------------------------------------------------------------- log records tagged with the id

_installed = False


def install_log_record_factory() -> None:
    """Give every LogRecord `request_id` / `request_tag` from the current request (idempotent)."""
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = previous(*args, **kwargs)
        if not hasattr(record, "request_id"):
            ctx = current.get()
            record.request_id = ctx.request_id if ctx is not None else None
        if not hasattr(record, "request_tag"):
            record.request_tag = f"[{record.request_id}] " if record.request_id else ""
        return record

    logging.setLogRecordFactory(factory)
    _installed = True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(request_tag)s%(message)s"
