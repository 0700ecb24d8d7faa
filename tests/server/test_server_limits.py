"""API key (401), a full waiting queue (503 + Retry-After), and SIGTERM draining a real server process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
from server_harness import make_engine, read_metric, start_server  # noqa: E402

KEY = "test-key-123"


@pytest.fixture(scope="module")
def small(tiny_checkpoint):
    """One sequence at a time and one waiting slot, so a burst overflows the queue."""
    engine = make_engine(tiny_checkpoint, max_num_seqs=1)
    live = start_server(engine, served_model_name="tiny", api_key=KEY, max_waiting_requests=1)
    yield live
    live.stop()


def test_api_key_required_on_v1(small):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(small.v1 + "/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(small.v1 + "/completions", json={"model": "tiny", "prompt": "hi"}, headers=headers)
        assert r.status_code == 401
    assert httpx.get(small.base_url + "/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=small.v1, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=small.v1, api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_full_waiting_queue_gets_503_with_retry_after(small):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "a burst of requests", "max_tokens": 48, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=120, headers=headers) as client:
            return await asyncio.gather(*(client.post(small.v1 + "/completions", json=body) for _ in range(8)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert 503 in codes and 200 in codes, codes
    assert set(codes) <= {200, 503}, codes
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["Retry-After"]) >= 1
            assert "queue" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 48
    # The server keeps serving once the burst is over.
    r = httpx.post(small.v1 + "/completions", json={**body, "max_tokens": 2}, headers=headers, timeout=60)
    assert r.status_code == 200
    text = httpx.get(small.base_url + "/metrics").text
    assert read_metric(text, "deepinfer_http_responses_total", 'endpoint="/v1/completions",status="503"') >= 1


def test_sigterm_drains_in_flight_stream_then_exits(tiny_checkpoint):
    env = {**os.environ, "DEEPINFER_API_KEY": KEY}
    cmd = [sys.executable, "-m", "deepinfer.entrypoints.openai.server", tiny_checkpoint, "--device", "cpu",
           "--dtype", "float32", "--port", "0", "--max-model-len", "512", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        banner, url = [], None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            banner.append(line)
            m = re.search(r"serving on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        text = "".join(banner)
        assert url, f"no URL in start-up output:\n{text}"
        assert "backend: cpu" in text and re.search(r"KV cache: \d+ tokens", text), text
        assert httpx.get(url + "/v1/models").status_code == 401  # DEEPINFER_API_KEY was honoured

        body = {"model": tiny_checkpoint, "prompt": "drain me", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 1:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]] == ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == 200
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read()
        assert "draining 1 in-flight" in out, out  # the signal came while the stream was running
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_and_cli_import_without_server_dependencies():
    """fastapi / uvicorn / pydantic / prometheus_client stay out of `import deepinfer` and the CLI's import."""
    code = (
        "import sys, deepinfer, deepinfer.engine, deepinfer.entrypoints.cli\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'uvicorn', 'pydantic', 'prometheus_client',"
        " 'starlette'})\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
