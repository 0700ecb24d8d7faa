"""Helpers for the server tests: a tiny checkpoint, a real engine, a real uvicorn server on loopback.

One server per test module (module-scoped): the engine loads once and every
test drives it over HTTP with the official `openai` client or httpx.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    from deepinfer.checkpoints import make_checkpoint

    path = str(tmp_path_factory.mktemp("server_ckpt") / "tiny-v2-lite")
    make_checkpoint("tiny-v2-lite", path)
    return path


def make_engine(path: str, **overrides):
    from deepinfer import DeepInferenceEngine, EngineConfig

    kwargs = dict(
        model_name_or_path=path, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32, seed=0
    )
    kwargs.update(overrides)
    return DeepInferenceEngine.from_config(EngineConfig(**kwargs))


@dataclass
class LiveServer:
    """A uvicorn server running build_app(engine) in a background thread."""

    app: object
    server: object
    thread: threading.Thread
    base_url: str

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    @property
    def async_engine(self):
        return self.app.state.deepinfer.async_engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(engine, **app_kwargs) -> LiveServer:
    import uvicorn

    from deepinfer.entrypoints.openai.app import build_app

    app = build_app(engine, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # so asyncio sets TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(app, server, thread, f"http://127.0.0.1:{port}")


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll until predicate() is truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def read_metric(text: str, name: str, labels: str | None = None) -> float | None:
    """The value of one sample in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == name or (labels is not None and key == f"{name}{{{labels}}}"):
            return float(value)
    return None


def start_production_server(engine, connection_limits=None, drain_timeout=None, **app_kwargs) -> LiveServer:
    """Like start_server, but with what `deepinfer serve` runs: server.uvicorn_config (its HTTP protocol
    class: header timeout, 431, connection cap; uvicorn's keep-alive timeout) and DrainingServer."""
    from deepinfer.entrypoints.openai.app import build_app
    from deepinfer.entrypoints.openai.http_protocol import ConnectionLimits
    from deepinfer.entrypoints.openai.server import DrainingServer, uvicorn_config

    limits = connection_limits or ConnectionLimits()
    app = build_app(engine, connection_limits=limits, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = DrainingServer(uvicorn_config(app, limits, log_level="warning", drain_timeout=drain_timeout),
                            app.state.deepinfer.async_engine, drain_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(app, server, thread, f"http://127.0.0.1:{port}")
