"""Connection limits uvicorn does not have: a header read timeout, 431 for an oversize header
block, and a cap on open connections answered with the OpenAI error body.

uvicorn (0.29+) has `timeout_keep_alive` (an idle kept-alive connection is closed) and
`h11_max_incomplete_event_size` (h11 refuses to buffer more than that many bytes of an incomplete
request head), but nothing bounds the time a client takes to send its request line and headers:
a slowloris client that sends one header byte every few seconds holds its connection forever.
`protocol_class(limits)` returns a small subclass of uvicorn's h11 protocol (the `http=` class of
uvicorn.Config) that

- arms a timer when a connection opens and when the first bytes of a request arrive, and disarms
  it once h11 has the complete request head. When it fires, a connection that sent part of a
  request gets a 408 with the OpenAI error body and is closed; one that sent nothing is closed;
- answers 431 (instead of uvicorn's 400) when h11 refused an incomplete request head for being
  longer than `max_head_bytes`;
- marks each request of a connection opened beyond `max_connections` (scope key
  OVER_CAPACITY), so the ASGI guard (guard.py) answers it 503 + Retry-After with the OpenAI body
  and closes the connection (/health is still answered: probes of a saturated server succeed).

The request-body read timeout, the header count / size caps of a complete head, and the 503 body
live in the ASGI guard; the keep-alive timeout is uvicorn's own. The header timer uses the asyncio
protocol hooks (connection_made / data_received / connection_lost) and h11's public state
(`their_state`, `trailing_data`). Two overrides lean on uvicorn's H11Protocol internals, not a
documented API: `send_400_response` (its answer to an h11 parse error) and the `app` attribute
that `handle_events` runs for each request; tests/server/test_server_connections.py pins both
(an uvicorn that renamed them would fail those tests, not serve silently without the limits:
the 431 would be uvicorn's 400, and the cap would not mark requests).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("deepinfer.server")

OVER_CAPACITY = "deepinfer.over_capacity"  # ASGI scope key: the connection is beyond max_connections
# After a 408 / 431 written here, the rest of what the client is still sending is read and dropped for
# at most this long before the socket closes: closing with unread bytes makes the kernel send a RST,
# which can destroy the error response in the client's receive buffer before it is read.
LINGER_S = 2.0


@dataclass(frozen=True)
class ConnectionLimits:
    """What `deepinfer serve` bounds per connection (docs/serving.md, "Connections")."""

    header_timeout: float | None = 10.0  # seconds to send the request line and headers
    body_timeout: float | None = 30.0  # seconds to send the whole body once the headers are in (ASGI guard)
    keep_alive_timeout: float = 5.0  # seconds an idle kept-alive connection stays open (uvicorn)
    max_header_count: int = 100  # request headers (ASGI guard: 431)
    max_header_bytes: int = 16384  # bytes of the request headers, names + values (ASGI guard: 431)
    max_connections: int | None = 1024  # open connections; beyond: 503 (ASGI guard)

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds (got {value!r})")
        if not self.keep_alive_timeout > 0:
            raise ValueError(f"keep_alive_timeout must be > 0 seconds (got {self.keep_alive_timeout!r})")
        for name in ("max_header_count", "max_header_bytes", "max_connections"):
            value = getattr(self, name)
            if value is None and name == "max_connections":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")

    @property
    def max_head_bytes(self) -> int:
        """What h11 may buffer of an incomplete request head: the headers plus room for the request line."""
        return self.max_header_bytes + 8192


def raw_error(status: int, reason: str, message: str, code: str, param: str | None = None) -> bytes:
    """A complete HTTP/1.1 error response with the OpenAI body, written past h11 (which cannot
    answer a request it has not parsed); the caller closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
                      ensure_ascii=True, separators=(",", ":")).encode("ascii")
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode("ascii")
    return head + body


def protocol_class(limits: ConnectionLimits, on_reject: Callable[[int], None] | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `limits` (pass as uvicorn.Config(http=...)). `on_reject(status)` is
    called for each 408 / 431 answered here (the server counts them in /metrics)."""

    class DeepInferH11Protocol(H11Protocol):
        _header_timer = None
        _lingering = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._full_app = self.app
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._lingering:  # answered and closing: what the client still sends is dropped
                return
            super().data_received(data)
            # In the header phase (h11 is still waiting for a complete request head, and part of it is
            # here): the timer runs from the first byte; once the head is complete it stops.
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                self._disarm_header_timer()
            elif self.conn.trailing_data[0]:
                self._arm_header_timer()

        def handle_events(self) -> None:
            # Requests on a connection beyond the cap are marked; the guard answers them 503.
            cap = limits.max_connections
            self.app = self._capped_app if cap is not None and len(self.connections) > cap else self._full_app
            super().handle_events()

        async def _capped_app(self, scope, receive, send):
            scope[OVER_CAPACITY] = True
            await self._full_app(scope, receive, send)

        def send_400_response(self, msg: str) -> None:
            # h11 refused the request head: 431 when it was too long, else uvicorn's 400.
            if len(self.conn.trailing_data[0]) > limits.max_head_bytes:
                self._reject(431, "Request Header Fields Too Large",
                             f"the request line and headers exceed {limits.max_header_bytes} bytes",
                             "request_header_fields_too_large", "headers")
                return
            super().send_400_response(msg)

        # ---------------------------------------------------------------- header timeout

        def _arm_header_timer(self) -> None:
            if limits.header_timeout is not None and self._header_timer is None:
                self._header_timer = self.loop.call_later(limits.header_timeout, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.trailing_data[0]:
                self._reject(408, "Request Timeout",
                             f"the request line and headers did not arrive within {limits.header_timeout:g} s",
                             "request_timeout")
            else:  # nothing sent at all: no request to answer
                self.transport.close()

        def _reject(self, status: int, reason: str, message: str, code: str, param: str | None = None) -> None:
            client = "%s:%d" % self.client if self.client else "-"
            logger.info("%s: %d %s", client, status, message)
            self.transport.write(raw_error(status, reason, message, code, param))
            self._close_lingering()
            if on_reject is not None:
                on_reject(status)

        def _close_lingering(self) -> None:
            """Send FIN after the response (half-close), drop what still arrives, close when the client
            does or after LINGER_S: the client reads the error instead of a connection reset."""
            self._disarm_header_timer()
            self._lingering = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()

        def eof_received(self) -> bool | None:
            if self._lingering:
                self.transport.close()
                return None
            return super().eof_received()

    return DeepInferH11Protocol
