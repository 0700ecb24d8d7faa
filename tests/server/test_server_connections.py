"""Connection limits (issue 11, item 6): header / body read timeouts, keep-alive idle timeout, header
count / size caps, a cap on open connections. What a client sees at each limit is in docs/serving.md
("Connections").

A real server on loopback with what `deepinfer serve` runs (server.uvicorn_config: DeepInfer's h11
protocol class, DrainingServer), driven with raw sockets (slow, stalled and oversize clients) and
httpx / the official `openai` client.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
from server_harness import (  # noqa: E402
    assert_responsive,
    make_engine,
    read_metric,
    start_production_server,
    wait_for,
)

MODEL = "tiny"
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
KEEP_ALIVE = 1.0


@pytest.fixture(scope="module")
def limited(tiny_checkpoint):
    from deepinfer.entrypoints.openai.http_protocol import ConnectionLimits

    limits = ConnectionLimits(header_timeout=HEADER_TIMEOUT, body_timeout=BODY_TIMEOUT, keep_alive_timeout=KEEP_ALIVE,
                              max_header_count=20, max_header_bytes=2048, max_connections=64)
    live = start_production_server(make_engine(tiny_checkpoint, max_num_seqs=4), limits, served_model_name=MODEL)
    yield live
    live.stop()


def _addr(live) -> tuple[str, int]:
    url = urlparse(live.base_url)
    return url.hostname, url.port


def _connect(live) -> socket.socket:
    return socket.create_connection(_addr(live), timeout=15)


def _read_response(sock: socket.socket) -> tuple[int | None, dict[str, str], bytes, bool]:
    """(status, headers, body, closed) of one response; status None when the server closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, {}, data, True
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    closed = False
    if headers.get("connection", "").lower() == "close":
        sock.settimeout(5)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:  # closed too (the server lingers after an early error to avoid this)
            closed = True
    return status, headers, body, closed


def _error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


class HealthPoller:
    """Polls /health on its own thread; `latencies` in seconds (every poll must be a 200)."""

    def __init__(self, live, interval: float = 0.01):
        self.live, self.interval = live, interval
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=10) as c:
            while not self._stop.is_set():
                t = time.monotonic()
                r = c.get(self.live.base_url + "/health")
                self.latencies.append(time.monotonic() - t)
                if r.status_code != 200:
                    self.failures.append(r.text)
                time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


# ---------------------------------------------------------------- header read timeout (slowloris)


def test_slowloris_is_cut_after_the_header_timeout_while_health_stays_fast(limited):
    slow = [_connect(limited) for _ in range(4)]
    silent = _connect(limited)  # connects and sends nothing at all
    started = time.monotonic()
    for s in slow:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    cut_at: dict[int, float] = {}
    replies: dict[int, bytes] = {}
    with HealthPoller(limited) as poller:
        # one more header line every 0.2 s, never the blank line that ends the head
        while len(cut_at) < len(slow) and time.monotonic() - started < 10:
            for i, s in enumerate(slow):
                if i in cut_at:
                    continue
                try:
                    s.sendall(b"X-Slow-%d: y\r\n" % i)
                    s.settimeout(0.2)
                    chunk = s.recv(65536)
                except socket.timeout:
                    continue
                except OSError:
                    chunk = b""
                replies[i] = replies.get(i, b"") + chunk
                cut_at[i] = time.monotonic() - started
            time.sleep(0.01)
    assert len(cut_at) == len(slow), cut_at
    for i, s in enumerate(slow):
        assert HEADER_TIMEOUT * 0.9 <= cut_at[i] < HEADER_TIMEOUT + 2.5, cut_at
        s.settimeout(5)
        reply = replies[i]
        while True:  # the rest of the 408 and then EOF
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            reply += chunk
        s.close()
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        head, _, body = reply.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower()
        assert _error(body)["code"] == "request_timeout"
    assert not poller.failures
    assert_responsive(poller.latencies)
    # The connection that sent nothing is closed quietly (there is no request to answer).
    silent.settimeout(HEADER_TIMEOUT + 5)
    assert silent.recv(1) == b""
    silent.close()
    assert time.monotonic() - started >= HEADER_TIMEOUT * 0.9
    text = httpx.get(limited.base_url + "/metrics").text
    assert read_metric(text, "deepinfer_http_responses_total", 'endpoint="other",status="408"') >= len(slow)


def test_a_slow_but_complete_head_within_the_timeout_is_served(limited):
    with _connect(limited) as s:
        for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"Connection: close\r\n", b"\r\n"):
            s.sendall(part)
            time.sleep(HEADER_TIMEOUT / 8)
        status, _, body, _ = _read_response(s)
    assert status == 200 and json.loads(body) == {"status": "ok"}


# ---------------------------------------------------------------- body read timeout


def _post_head(length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_stalled_or_trickling_body_gets_408(limited):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    # stalled: a third of the body, then nothing
    with _connect(limited) as s:
        t0 = time.monotonic()
        s.sendall(_post_head(len(body)) + body[: len(body) // 3])
        status, headers, reply, closed = _read_response(s)
        elapsed = time.monotonic() - t0
    assert status == 408, reply
    assert BODY_TIMEOUT * 0.9 <= elapsed < BODY_TIMEOUT + 3, elapsed
    assert _error(reply)["code"] == "request_timeout" and "body" in _error(reply)["message"]
    assert headers["connection"].lower() == "close" and closed
    assert headers.get("x-request-id")
    # trickling: one byte every 0.1 s; the timeout bounds the whole body, not the gap between bytes
    with _connect(limited) as s:
        t0 = time.monotonic()
        s.sendall(_post_head(len(body)))
        s.settimeout(0.1)
        reply = b""
        for byte in body:
            try:
                s.sendall(bytes([byte]))
                reply += s.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if reply:
                break
        elapsed = time.monotonic() - t0
        s.settimeout(5)
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert elapsed < BODY_TIMEOUT + 3, elapsed
    # a body sent in time, even in pieces, is served
    with _connect(limited) as s:
        s.sendall(_post_head(len(body)) + body[:10])
        time.sleep(BODY_TIMEOUT / 4)
        s.sendall(body[10:])
        status, _, reply, _ = _read_response(s)
    assert status == 200, reply
    text = httpx.get(limited.base_url + "/metrics").text
    assert read_metric(text, "deepinfer_http_responses_total", 'endpoint="/v1/completions",status="408"') >= 2


# ---------------------------------------------------------------- header count / size: 431


def test_too_many_or_too_large_headers_get_431(limited):
    before = httpx.get(limited.base_url + "/health")
    assert before.status_code == 200
    many = {f"x-extra-{i}": "v" for i in range(25)}
    for path in ("/health", "/v1/models"):
        r = httpx.get(limited.base_url + path, headers=many)
        assert r.status_code == 431, r.text
        err = _error(r.content)
        assert err["code"] == "request_header_fields_too_large" and err["param"] == "headers"
        assert "25" in err["message"] or "headers" in err["message"]
        assert r.headers["connection"] == "close"
    r = httpx.post(limited.v1 + "/completions", headers={"x-big": "v" * 3000},
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 431 and "bytes" in _error(r.content)["message"]
    # A complete head far over the cap, sent at once: the guard's 431.
    with _connect(limited) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Huge: " + b"h" * 12_000 + b"\r\n\r\n")
        status, headers, body, closed = _read_response(s)
    assert status == 431 and closed, body
    # An incomplete head longer than h11 may buffer (headers + 8 KiB for the request line): the
    # protocol's 431, not uvicorn's 400.
    with _connect(limited) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(40):
                s.sendall(b"X-Pad: " + b"p" * 500 + b"\r\n")
        except OSError:
            pass
        status, headers, body, closed = _read_response(s)
    assert status == 431, body
    assert _error(body)["code"] == "request_header_fields_too_large"
    # At the caps: served.
    r = httpx.get(limited.base_url + "/health", headers={f"x-ok-{i}": "v" for i in range(10)})
    assert r.status_code == 200


# ---------------------------------------------------------------- keep-alive idle timeout


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(limited):
    with _connect(limited) as s:
        for _ in range(2):  # kept alive between requests sent in time
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, _, _ = _read_response(s)
            assert status == 200 and headers.get("connection", "") != "close"
            time.sleep(KEEP_ALIVE / 3)
        t0 = time.monotonic()
        s.settimeout(KEEP_ALIVE + 5)
        assert s.recv(1) == b""  # closed by the server, no response
        idle = time.monotonic() - t0
    assert KEEP_ALIVE * 0.5 <= idle < KEEP_ALIVE + 2, idle


# ---------------------------------------------------------------- connection cap: 503


def test_connections_beyond_the_cap_get_503_with_retry_after(tiny_checkpoint):
    from deepinfer.entrypoints.openai.http_protocol import ConnectionLimits

    limits = ConnectionLimits(keep_alive_timeout=60, max_connections=2)
    live = start_production_server(make_engine(tiny_checkpoint, max_num_seqs=2), limits, served_model_name=MODEL)
    held = []
    try:
        for _ in range(2):  # two kept-alive connections fill the cap
            s = _connect(live)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(s)[0] == 200
            held.append(s)
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        with _connect(live) as s:
            s.sendall(_post_head(len(body)) + body)
            status, headers, reply, closed = _read_response(s)
        assert status == 503, reply
        err = _error(reply)
        assert err["code"] == "server_overloaded" and "connection limit (2)" in err["message"]
        assert int(headers["retry-after"]) >= 1 and headers["connection"] == "close" and closed
        # /health is still answered beyond the cap (a probe must not restart a saturated server)
        r = httpx.get(live.base_url + "/health")
        assert r.status_code == 200 and r.headers["connection"] == "close"
        # the official client sees a 503 (an APIStatusError) with the OpenAI body
        client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "server_overloaded"
        # one connection closes: a new one is served
        held.pop().close()
        assert wait_for(lambda: len(live.server.server_state.connections) <= 1)
        r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens >= 1
        client.close()
        assert wait_for(lambda: len(live.server.server_state.connections) <= 1)
        r = httpx.get(live.base_url + "/metrics")
        assert r.status_code == 200
        text = r.text
        assert read_metric(text, "deepinfer_http_responses_total", 'endpoint="/v1/completions",status="503"') >= 2
    finally:
        for s in held:
            s.close()
        live.stop()


# ---------------------------------------------------------------- flags


def test_connection_flags_and_defaults():
    import argparse

    from deepinfer.entrypoints.cli_serve import add_serve_arguments
    from deepinfer.entrypoints.openai.http_protocol import ConnectionLimits
    from deepinfer.entrypoints.openai.server import connection_limits_from_args
    from deepinfer.errors import ConfigError

    parser = add_serve_arguments(argparse.ArgumentParser())
    assert connection_limits_from_args(parser.parse_args(["m"])) == ConnectionLimits(
        header_timeout=10, body_timeout=30, keep_alive_timeout=5, max_header_count=100, max_header_bytes=16384,
        max_connections=1024)
    args = parser.parse_args(["m", "--header-timeout", "2.5", "--body-timeout", "0", "--keep-alive-timeout", "7",
                              "--max-header-count", "50", "--max-header-bytes", "8192", "--max-connections", "0"])
    assert connection_limits_from_args(args) == ConnectionLimits(2.5, None, 7, 50, 8192, None)
    for flag, value in (("--keep-alive-timeout", "0"), ("--max-header-count", "0"), ("--header-timeout", "-1"),
                        ("--max-header-bytes", "-5")):
        with pytest.raises(ConfigError, match=flag):
            connection_limits_from_args(parser.parse_args(["m", flag, value]))
