"""SIGTERM drains a real `deepinfer serve` process (issue 11, operators' view; docs/serving.md "Draining"):
/health answers 503 `draining`, new generation requests get 503 + the OpenAI body + Retry-After,
the stream in flight finishes normally, then the process exits 0; --drain-timeout bounds the wait.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
from server_harness import start_server_process  # noqa: E402

MODEL = "tiny"


def _start(tiny_checkpoint, *flags):
    return start_server_process(tiny_checkpoint, MODEL, "--log-level", "warning", "--no-access-log", *flags)


class Stream(threading.Thread):
    """One long completion stream; `events` as they arrive, `first` set on the first one."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[str] = []
        self.first = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self):
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line:
                        self.events.append(line)
                        self.first.set()
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            self.error = exc
        finally:
            self.first.set()
            self.done.set()


def test_sigterm_health_draining_new_requests_503_stream_finishes_exit_0(tiny_checkpoint):
    proc, url = _start(tiny_checkpoint)
    try:
        stream = Stream(url, max_tokens=480)
        stream.start()
        assert stream.first.wait(60) and not stream.error
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the signal handler runs on the server's event loop thread
        with httpx.Client(timeout=30) as c:
            health = c.get(url + "/health")
            completion = c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            chat = c.post(url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            head = c.head(url + "/health")
        in_flight = not stream.done.is_set()
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert in_flight, "the stream ended before the checks: make it longer"
        assert health.status_code == 503 and health.json() == {"status": "draining"}, health.text
        assert int(health.headers["retry-after"]) >= 1 and health.headers["connection"] == "close"
        assert head.status_code == 503 and head.content == b""
        for r in (completion, chat):
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "server_overloaded" and "shutting down" in err["message"]
            assert int(r.headers["retry-after"]) >= 1
        assert info.value.status_code == 503 and info.value.body["code"] == "server_overloaded"
        # the stream in flight runs to its end
        assert stream.done.wait(120) and stream.error is None, stream.error
        assert stream.events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in stream.events[:-1]]
        assert [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]] == ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == 480
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read()
        assert "draining 1 in-flight" in out and "server stopped" in out, out
        assert "Traceback" not in out, out
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_timeout_bounds_the_wait(tiny_checkpoint):
    # a stream far longer than the 1 s drain (the cpu backend decodes the tiny model at hundreds of tokens
    # per second, so 480 tokens could finish inside the drain and the test would see its end)
    proc, url = _start(tiny_checkpoint, "--drain-timeout", "1", "--max-model-len", "4096")
    try:
        stream = Stream(url, max_tokens=4000)
        stream.start()
        assert stream.first.wait(60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        elapsed = time.monotonic() - t0
        assert elapsed < 6, elapsed  # 1 s of drain, at most 1 s more for responses being written
        assert stream.done.wait(30)
        assert not any('"finish_reason":"length"' in e for e in stream.events)  # cut before its end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
