"""The OpenAI-compatible server as a process: flags -> limits, uvicorn with DeepInfer's HTTP protocol
class, signals and draining; `run_server(args)` is what `deepinfer serve` calls.

    python -m deepinfer.entrypoints.openai.server MODEL_PATH --port 8000
    deepinfer serve MODEL_PATH --port 8000          (the CLI calls run_server)

The app itself (routes, the engine loop's lifespan) is app.py's `build_app`; the guard in front of
it guard.py's; the header read timeout and the connection cap live in the HTTP protocol class
(http_protocol.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI

import deepinfer
from deepinfer import envs
from deepinfer.entrypoints.openai.app import build_app
from deepinfer.entrypoints.openai.async_engine import AsyncEngine
from deepinfer.entrypoints.openai.guard import DEFAULT_MAX_BODY_BYTES, check_api_key
from deepinfer.entrypoints.openai.http_protocol import ConnectionLimits, protocol_class
from deepinfer.entrypoints.openai.metrics import ServerMetrics
from deepinfer.entrypoints.openai.request_checks import ServerLimits
from deepinfer.entrypoints.openai.request_context import (
    LOG_FORMAT,
    install_log_record_factory,
)
from deepinfer.entrypoints.openai.serving_common import ServerState
from deepinfer.errors import ConfigError, DeepInferError

logger = logging.getLogger("deepinfer.server")


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
        model_path=engine.config.model_name_or_path,
        limits=limits,
        access_log=not getattr(args, "no_access_log", False),
        connection_limits=connection_limits,
        reasoning_parser=getattr(args, "reasoning_parser", None),
        json_whitespace=getattr(args, "json_whitespace", None) or "flexible",
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
        f"DeepInfer {deepinfer.__version__}: loaded {engine.config.model_name_or_path} as "
        f"{state.served_model_names[0]!r}\n"
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
