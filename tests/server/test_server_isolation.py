"""One request never hurts another (issue 11), and operators can follow each request.

- an engine failure inside one request's work is that request's 500 (or in-band SSE error event),
  while concurrent streams finish correctly;
- a multi-megabyte prompt is refused without stalling the event loop: /health answers in < 100 ms
  and a concurrent stream keeps receiving tokens;
- X-Request-Id is used (validated) or made, returned, in the completion id and in the log lines;
  one access-log line per request, switchable off.

A real server on loopback (in-process, so a test can inject a fault into its engine), driven by
the official `openai` client and raw httpx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
from server_harness import (  # noqa: E402
    MAX_MODEL_LEN,
    assert_responsive,
    collect_stream,
    health_latencies,
    make_engine,
    read_metric,
    start_server,
    start_server_process,
    wait_for,
)

MODEL = "tiny"
FAULT = "inject-fault"  # a request whose id holds this fails inside the engine after 2 tokens
USER = [{"role": "user", "content": "Tell me a story"}]


def install_fault(engine):
    """Test-only: output processing raises for requests whose id holds FAULT once they have 2 tokens.
    The engine's own isolation (sched/step_pipeline.py) fails that request alone: RequestOutput.error
    is set and its sequences finish with "error"."""
    original = engine.output_processor.append_token

    def faulty(seq, token_id, logprobs):
        if FAULT in seq.request.request_id and len(seq.output_token_ids) >= 2:
            raise RuntimeError("injected fault at /very/secret/path")
        return original(seq, token_id, logprobs)

    engine.output_processor.append_token = faulty


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    install_fault(engine)
    live = start_server(engine, served_model_name=MODEL)
    live.engine = engine
    yield live
    live.stop()


def metrics(live) -> str:
    return httpx.get(live.base_url + "/metrics").text


def kv_free(live) -> bool:
    return wait_for(lambda: live.async_engine.num_in_flight == 0
                    and read_metric(metrics(live), "deepinfer_kv_blocks_used") == 0)


async def good_stream(client: openai.AsyncOpenAI, i: int, max_tokens: int = 16) -> tuple[str, list[str]]:
    stream = await client.completions.create(model=MODEL, prompt=f"A good stream number {i}", stream=True,
                                             temperature=0, max_tokens=max_tokens, extra_body={"ignore_eos": True})
    return await collect_stream(stream)


def greedy_refs(live, n: int, max_tokens: int = 16) -> list[str]:
    client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)
    return [client.completions.create(model=MODEL, prompt=f"A good stream number {i}", temperature=0,
                                      max_tokens=max_tokens, extra_body={"ignore_eos": True}).choices[0].text
            for i in range(n)]


def sse_events(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


# ---------------------------------------------------------------- engine errors are per request


def test_engine_failure_is_that_requests_500_others_finish(served):
    refs = greedy_refs(served, 4)
    finished_error = read_metric(metrics(served), "deepinfer_requests_finished_total", 'finish_reason="error"') or 0

    async def main():
        async with openai.AsyncOpenAI(base_url=served.v1, api_key="x", max_retries=0, timeout=120) as client, \
                httpx.AsyncClient(timeout=120) as raw:
            bad = [
                raw.post(served.v1 + "/completions", headers={"X-Request-Id": f"{FAULT}-c1"},
                         json={"model": MODEL, "prompt": "doomed", "max_tokens": 30, "ignore_eos": True}),
                raw.post(served.v1 + "/chat/completions", headers={"X-Request-Id": f"{FAULT}-h1"},
                         json={"model": MODEL, "messages": USER, "max_tokens": 30, "ignore_eos": True, "n": 2}),
                raw.post(served.v1 + "/completions", headers={"X-Request-Id": f"{FAULT}-multi"},
                         json={"model": MODEL, "prompt": ["one", "two"], "max_tokens": 30, "ignore_eos": True}),
            ]
            return await asyncio.gather(*(good_stream(client, i) for i in range(4)), *bad)

    *goods, c1, h1, multi = asyncio.run(main())
    for (text, reasons), ref in zip(goods, refs):
        assert reasons == ["length"] and text == ref
    for r, rid in ((c1, f"cmpl-{FAULT}-c1"), (h1, f"chatcmpl-{FAULT}-h1"), (multi, f"cmpl-{FAULT}-multi")):
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "internal_error" and err["type"] == "server_error"
        assert "Internal error" in err["message"] and rid in err["message"], err
        for leak in ("Traceback", "RuntimeError", "secret", "injected"):
            assert leak not in r.text
    assert kv_free(served)
    after = read_metric(metrics(served), "deepinfer_requests_finished_total", 'finish_reason="error"')
    assert after >= finished_error + 3


def test_engine_failure_mid_stream_is_an_error_event_then_done(served):
    refs = greedy_refs(served, 3)
    bodies = [
        ("completions", {"model": MODEL, "prompt": "doomed stream", "max_tokens": 30, "ignore_eos": True,
                         "stream": True, "stream_options": {"include_usage": True}}, f"{FAULT}-s1", "cmpl"),
        ("chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 30, "ignore_eos": True,
                              "stream": True}, f"{FAULT}-s2", "chatcmpl"),
    ]

    async def bad_stream(raw, path, body, rid):
        async with raw.stream("POST", f"{served.v1}/{path}", json=body, headers={"X-Request-Id": rid}) as r:
            assert r.status_code == 200
            return [line async for line in r.aiter_lines()]

    async def main():
        async with openai.AsyncOpenAI(base_url=served.v1, api_key="x", max_retries=0, timeout=120) as client, \
                httpx.AsyncClient(timeout=120) as raw:
            return await asyncio.gather(*(good_stream(client, i) for i in range(3)),
                                        *(bad_stream(raw, p, b, rid) for p, b, rid, _ in bodies))

    *goods, s1, s2 = asyncio.run(main())
    for (text, reasons), ref in zip(goods, refs):
        assert reasons == ["length"] and text == ref
    for lines, (_, _, rid, prefix) in zip((s1, s2), bodies):
        events = sse_events(lines)
        assert events[-1] == "[DONE]"  # ... and the stream closed (aiter_lines ended)
        err = json.loads(events[-2])["error"]
        assert err["code"] == "internal_error" and f"{prefix}-{rid}" in err["message"]
        assert "secret" not in "".join(lines)
        chunks = [json.loads(e) for e in events[:-2]]
        assert chunks and all(ch["id"] == f"{prefix}-{rid}" for ch in chunks)  # tokens came before the failure
        assert not any(c.get("finish_reason") for ch in chunks for c in ch["choices"])
    assert kv_free(served)


def test_a_whole_step_failure_is_a_500_without_the_exception_text(served):
    """Not one request's failure (engine.step() itself raised): every request in flight gets the 500
    (or error event), the exception stays in the server log, and the server goes on serving."""
    engine = served.engine
    real_step = engine.step
    armed = {"left": 1}

    def step():
        if armed["left"] and engine.has_unfinished_requests():
            armed["left"] -= 1
            raise RuntimeError("device fault at /very/secret/path")
        return real_step()

    engine.step = step
    try:
        r = httpx.post(served.v1 + "/completions", headers={"X-Request-Id": "step-fail-1"}, timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    finally:
        engine.step = real_step
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "internal_error" and "cmpl-step-fail-1" in err["message"]
    assert "secret" not in r.text and "RuntimeError" not in r.text
    assert kv_free(served)
    ok = httpx.post(served.v1 + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


# ---------------------------------------------------------------- the event loop never blocks


def test_multi_megabyte_prompts_do_not_stall_health_or_streams(served):
    big_text = json.dumps({"model": MODEL, "prompt": "hello world " * 500_000, "max_tokens": 4}).encode()  # 6 MB
    no_spaces = json.dumps({"model": MODEL, "prompt": "x" * 6_000_000}).encode()
    big_chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "数据 " * 900_000}]},
                          ensure_ascii=False).encode()  # 6.3 MB of UTF-8
    assert all(4_000_000 < len(b) < 8 * 1024 * 1024 for b in (big_text, no_spaces, big_chat))
    headers = {"content-type": "application/json"}

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            token_times: list[float] = []
            done = asyncio.Event()

            async def stream():
                body = {"model": MODEL, "prompt": "keep streaming", "max_tokens": 400, "ignore_eos": True,
                        "stream": True}
                async with c.stream("POST", served.v1 + "/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            token_times.append(time.monotonic())
                done.set()

            def health(stop: asyncio.Event):
                return health_latencies(c, served.base_url, stop)

            streaming = asyncio.ensure_future(stream())
            while len(token_times) < 3:
                await asyncio.sleep(0.01)
            stop = asyncio.Event()
            poll = asyncio.ensure_future(health(stop))
            t0 = time.monotonic()
            replies = []
            for _ in range(3):
                replies += await asyncio.gather(*(c.post(served.v1 + path, content=b, headers=headers)
                                                  for path, b in (("/completions", big_text),
                                                                  ("/completions", no_spaces),
                                                                  ("/chat/completions", big_chat))))
            t1 = time.monotonic()
            stop.set()
            latencies = await poll
            during = [t for t in token_times if t0 <= t <= t1]
            streaming.cancel()
            await asyncio.gather(streaming, return_exceptions=True)
            return replies, latencies, t1 - t0, during

    replies, latencies, elapsed, during = asyncio.run(main())
    for r in replies:
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] in ("prompt", "messages")
        assert f"{MAX_MODEL_LEN} tokens" in err["message"]
    assert_responsive(latencies)
    assert elapsed < 10, elapsed  # 9 multi-MB prompts refused (an 8 MB one used to take 42 s)
    assert len(during) >= 2, (len(during), elapsed)  # the concurrent stream kept receiving tokens
    assert kv_free(served)


def test_encode_within_is_exact_when_it_fits_and_sound_when_it_refuses(served):
    """A prompt that may fit is tokenized in one piece (the engine's own ids); a refusal happens only
    when the whole text really has >= max_model_len tokens, after a bounded amount of tokenizing."""
    from deepinfer.entrypoints.openai import request_checks as rc

    tok = served.engine.tokenizer
    calls = []

    class Counting:
        def encode(self, text, add_special_tokens=True):
            calls.append(len(text))
            return tok.encode(text, add_special_tokens=add_special_tokens)

    words = ["alpha", "beta", "你好世界", "😀", "x" * 40, "\n", "<｜User｜>", "42"]
    for i, n in enumerate((3_000, 5_000, 9_000, 30_000)):
        text = " ".join(words[(i * j) % len(words)] for j in range(n))
        whole = tok.encode(text)
        for limit in (len(whole) - 50, len(whole) + 1, len(whole) + 500):
            try:
                ids = rc.encode_within(tok, text, limit)
            except rc.PromptTooLong as exc:
                assert len(whole) >= limit and exc.at_least <= len(whole)
            else:
                assert ids == whole
    runs = "你好" * 200_000 + "x" * 300_000  # no whitespace at all: hard cuts
    calls.clear()
    with pytest.raises(rc.PromptTooLong):
        rc.encode_within(Counting(), runs, MAX_MODEL_LEN)
    assert max(calls) <= rc.CHUNK_CHARS and sum(calls) < 100_000  # a small prefix of a 700K-character text


# ---------------------------------------------------------------- X-Request-Id and the access log


def test_x_request_id_used_returned_and_in_completion_ids(served):
    client = openai.OpenAI(base_url=served.v1, api_key="x", max_retries=0, timeout=60,
                           default_headers={"X-Request-Id": "client-id-42"})
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
    assert raw.headers["x-request-id"] == "client-id-42"
    assert raw.parse().id == "cmpl-client-id-42"
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=USER, max_tokens=2)
    assert raw.headers["x-request-id"] == "client-id-42" and raw.parse().id == "chatcmpl-client-id-42"
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, stream=True)
    assert {ch.id for ch in stream} == {"chatcmpl-client-id-42"}

    # Invalid ids (too long, spaces, non-ASCII, control bytes) are replaced by a fresh one.
    for bad in (b"x" * 129, b"has space", b"caf\xc3\xa9", b"tab\there", b""):
        r = httpx.post(served.v1 + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                       headers=[(b"x-request-id", bad)])
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid) and r.json()["id"] == f"cmpl-{rid}"
    # None sent: one is made; every response carries it, errors included.
    r = httpx.post(served.v1 + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    for r in (httpx.post(served.v1 + "/completions", json={"model": MODEL, "prompt": "hi", "n": 0}),
              httpx.post(served.v1 + "/completions", json={"model": "nope", "prompt": "hi"}),
              httpx.get(served.base_url + "/health", headers={"X-Request-Id": "probe-1"}),
              httpx.get(served.v1 + "/nothing-here", headers={"X-Request-Id": "missing-1"})):
        assert r.headers.get("x-request-id"), r
    assert r.headers["x-request-id"] == "missing-1"


def test_a_reused_request_id_in_flight_does_not_clash(served):
    async def main():
        async with httpx.AsyncClient(timeout=120, headers={"X-Request-Id": "same-id"}) as c:
            body = {"model": MODEL, "prompt": "twins", "max_tokens": 12, "ignore_eos": True}
            return await asyncio.gather(*(c.post(served.v1 + "/completions", json=body) for _ in range(3)))

    for r in asyncio.run(main()):
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "cmpl-same-id" and r.json()["usage"]["completion_tokens"] == 12
    assert kv_free(served)


def test_every_log_line_and_one_access_line_per_request(served, caplog):
    caplog.set_level(logging.DEBUG, logger="deepinfer")
    client = openai.OpenAI(base_url=served.v1, api_key="x", max_retries=0, timeout=60)
    client.completions.create(model=MODEL, prompt="hello there", max_tokens=5, extra_body={"ignore_eos": True,
                              "an_unknown_field": 1}, extra_headers={"X-Request-Id": "log-me-1"})
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "log-me-2"})
    assert len(list(stream)) > 1
    httpx.post(served.v1 + "/completions", json={"model": MODEL, "prompt": "hi", "top_p": 9},
               headers={"X-Request-Id": "log-me-3"})
    httpx.post(served.v1 + "/completions", headers={"X-Request-Id": f"{FAULT}-log"},
               json={"model": MODEL, "prompt": "doomed", "max_tokens": 20, "ignore_eos": True})

    def access(rid):
        wait_for(lambda: any(r.name == "deepinfer.access" and r.request_id == rid for r in caplog.records))
        lines = [r for r in caplog.records if r.name == "deepinfer.access" and r.request_id == rid]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert lines[0].levelno == logging.INFO
        return lines[0].getMessage()

    line = access("log-me-1")
    assert re.search(r'"POST /v1/completions" 200 prompt_tokens=\d+ completion_tokens=5 ttft=\d+\.\d+s total=\d+\.\d+s',
                     line), line
    line = access("log-me-2")
    assert '"POST /v1/chat/completions" 200' in line and "completion_tokens=4" in line and "ttft=0." in line, line
    line = access("log-me-3")
    assert '" 400 prompt_tokens=- completion_tokens=- ttft=- total=' in line, line
    line = access(f"{FAULT}-log")
    assert '" 500 ' in line and "completion_tokens=2" in line, line
    # Other lines about a request carry its id too: the debug line about ignored fields, the engine's
    # failure line (written on the engine thread, naming the engine request id in the message).
    debug = [r for r in caplog.records if "ignoring request fields" in r.getMessage()]
    assert debug and all(r.request_id == "log-me-1" for r in debug)
    failure = [r for r in caplog.records if "failed" in r.getMessage() and f"cmpl-{FAULT}-log" in r.getMessage()]
    assert failure, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    from deepinfer.entrypoints.openai.request_context import LOG_FORMAT

    formatted = logging.Formatter(LOG_FORMAT).format(debug[0])
    assert "[log-me-1] ignoring request fields" in formatted


def test_no_access_log(tiny_checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="deepinfer.access")
    live = start_server(make_engine(tiny_checkpoint, max_num_seqs=2), served_model_name=MODEL, access_log=False)
    try:
        r = httpx.post(live.v1 + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers={"X-Request-Id": "quiet-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "quiet-1"
        assert httpx.get(live.base_url + "/health").status_code == 200
    finally:
        live.stop()
    assert not [r for r in caplog.records if r.name == "deepinfer.access"]


def _start_subprocess(tiny_checkpoint, *flags):
    return start_server_process(tiny_checkpoint, MODEL, *flags)


def _stop(proc) -> str:
    import signal

    proc.send_signal(signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    return out


def test_run_server_access_log_lines_and_keep_alive_latency(tiny_checkpoint):
    """`deepinfer serve` logs one tagged access line per request (uvicorn's own access log is off),
    --no-access-log turns it off, and keep-alive responses are not held back by Nagle's algorithm."""
    proc, url = _start_subprocess(tiny_checkpoint, "--log-level", "info")
    try:
        with httpx.Client(timeout=60) as c:
            r = c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
                       headers={"X-Request-Id": "sub-req-1"})
            assert r.status_code == 200 and r.json()["id"] == "cmpl-sub-req-1"
            latencies = []
            for _ in range(10):  # one kept-alive connection
                t = time.monotonic()
                assert c.get(url + "/health").status_code == 200
                latencies.append(time.monotonic() - t)
        assert sorted(latencies)[5] < 0.02, latencies  # ~0.04 s each when TCP_NODELAY is not set
    finally:
        out = _stop(proc)
    lines = [line for line in out.splitlines() if "deepinfer.access" in line]
    tagged = [line for line in lines if "[sub-req-1]" in line]
    assert len(tagged) == 1, out
    assert re.search(r'INFO deepinfer\.access: \[sub-req-1\] 127\.0\.0\.1:\d+ "POST /v1/completions" 200 '
                     r"prompt_tokens=\d+ completion_tokens=3 ttft=\d+\.\d+s total=\d+\.\d+s", tagged[0]), tagged[0]
    assert len([line for line in lines if '"GET /health" 200' in line]) == 10
    assert "HTTP/1.1" not in out  # uvicorn's own access line ('"GET /health HTTP/1.1" 200') is off

    proc, url = _start_subprocess(tiny_checkpoint, "--log-level", "info", "--no-access-log")
    try:
        assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                          timeout=60).status_code == 200
    finally:
        out = _stop(proc)
    assert "deepinfer.access" not in out and "HTTP/1.1" not in out, out
