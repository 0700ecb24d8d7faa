"""Bad input never hurts the server (issue 11): invalid Unicode, malformed Authorization headers,
per-request work caps, fail-closed fields, tiny temperatures and -inf / NaN log-probabilities.

A real server on loopback, driven by the official `openai` client and raw httpx; each bad input
gets a 4xx with the OpenAI error body naming the field, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
from server_harness import MAX_MODEL_LEN, make_engine, read_metric, start_server  # noqa: E402

MODEL = "tiny"
KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json", **AUTH}
USER = [{"role": "user", "content": "Hello there"}]


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity / -Infinity (Python's json accepts them by default)."""

    def refuse(name):
        raise AssertionError(f"non-JSON constant {name} in a response body")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    live = start_server(engine, served_model_name=MODEL, api_key=KEY)
    live.engine = engine
    yield live
    live.stop()


@pytest.fixture(scope="module")
def capped(tiny_checkpoint):
    """A second server with small caps, to check that the caps are configurable."""
    from deepinfer.entrypoints.openai.request_checks import ServerLimits

    engine = make_engine(tiny_checkpoint, max_num_seqs=8)
    limits = ServerLimits(max_choices_per_request=4, max_stop_strings=2, max_stop_chars=10, max_logprobs=3,
                          max_output_tokens=8)
    live = start_server(engine, served_model_name=MODEL, limits=limits)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=60)


def _ids(cases) -> list[str]:
    return [f"{path}-{param}-{i}" for i, (path, _, param) in enumerate(cases)]


def _post(live, path: str, raw: bytes, headers=None):
    return httpx.post(f"{live.v1}/{path}", content=raw, headers=headers or JSON, timeout=60)


def _assert_error(r, status: int, param: str | None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
        assert param in err["message"], err
    assert "Traceback" not in r.text
    return err


def _count_5xx(live) -> float:
    text = httpx.get(live.base_url + "/metrics").text
    total = 0.0
    for endpoint in ("/v1/completions", "/v1/chat/completions", "/v1/models", "other"):
        for status in ("500", "502", "503", "504"):
            labels = f'endpoint="{endpoint}",status="{status}"'
            total += read_metric(text, "deepinfer_http_responses_total", labels) or 0
    return total


# ---------------------------------------------------------------- invalid Unicode anywhere

SURROGATE_BODIES = [
    ("completions", rb'{"model": "tiny", "prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
    ("completions", rb'{"model": "tiny", "prompt": ["fine", "bad \udfff"], "max_tokens": 2}', "prompt"),
    ("completions", rb'{"model": "tiny\ud800", "prompt": "hi", "max_tokens": 2}', "model"),
    ("completions", rb'{"model": "tiny", "prompt": "hi", "stop": "\ud83d", "max_tokens": 2}', "stop"),
    ("completions", rb'{"model": "tiny", "prompt": "hi", "stop": ["ok", "\udc00x"], "max_tokens": 2}', "stop"),
    ("completions", rb'{"model": "tiny", "prompt": "hi", "user": "\ud800", "max_tokens": 2}', "user"),
    ("completions", rb'{"model": "tiny", "prompt": "hi", "some_extra": {"k": ["\ud800"]}, "max_tokens": 2}',
     "some_extra"),
    ("completions", rb'{"model": "tiny", "prompt": "hi", "logit_bias": {"\ud800": 1.0}}', "logit_bias"),
    ("chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "x\ud800"}]}', "messages"),
    ("chat/completions",
     rb'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]}',
     "messages"),
    ("chat/completions",
     rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}', "messages"),
    ("chat/completions", rb'{"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("chat/completions",
     rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]}', "stop"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATE_BODIES, ids=_ids(SURROGATE_BODIES))
def test_lone_surrogates_anywhere_are_400_naming_the_field(served, path, raw, param):
    err = _assert_error(_post(served, path, raw), 400, param)
    assert err["code"] == "invalid_unicode"
    assert "surrogate" in err["message"]


def test_invalid_utf8_body_and_surrogates_via_the_client(served, client):
    before = _count_5xx(served)
    err = _assert_error(_post(served, "completions", b'{"model": "tiny", "prompt": "a\xff\xfeb"}'), 400, "body")
    assert err["code"] == "invalid_json"
    # (The official client and httpx's json= cannot send a lone surrogate: they encode JSON as UTF-8.
    # json.dumps with its default ensure_ascii escapes it as \ud800, as other clients may: the same 400.)
    raw = json.dumps({"model": MODEL, "prompt": "abc\ud800"}).encode()
    r = httpx.post(served.v1 + "/completions", content=raw, headers=JSON)
    assert _assert_error(r, 400, "prompt")["code"] == "invalid_unicode"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       stop=["ok"], extra_body={"user": "x", "top_k": -7})
    assert info.value.body["param"] == "top_k"
    # Valid non-ASCII text (CJK, emoji, a noncharacter) is fine.
    r = client.completions.create(model=MODEL, prompt="你好 😀 \ufffe", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    assert _count_5xx(served) == before


# ---------------------------------------------------------------- Authorization headers

BAD_AUTH = [
    b"Bearer \xc3\xa9t\xc3\xa9",  # UTF-8 bytes
    b"Bearer " + KEY.encode() + b"\xe9",  # the key plus a Latin-1 byte
    b"\xff\xfe\xfd",
    b"Bearer",
    b"Basic " + KEY.encode(),
    KEY.encode(),
    b"",
    b"Bearer \x01\x02",
]


@pytest.mark.parametrize("value", BAD_AUTH, ids=[repr(v) for v in BAD_AUTH])
def test_malformed_or_non_ascii_authorization_is_401(served, value):
    headers = [(b"authorization", value), (b"content-type", b"application/json")]
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    for path in ("completions", "chat/completions"):
        r = httpx.post(f"{served.v1}/{path}", content=body, headers=headers, timeout=30)
        err = _assert_error(r, 401, None)
        assert err["code"] == "invalid_api_key"
    r = httpx.get(served.v1 + "/models", headers=headers, timeout=30)
    assert r.status_code == 401


def test_authorization_bytes_a_client_library_would_not_send(served):
    """Raw bytes on the socket (httpx refuses to send these): the server answers 401 (or its HTTP
    parser a 400), never a 500, and stays up."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(served.base_url)
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    for value in (b"Bearer ", b"Bearer \x80\x81\xff", b"Bearer\t" + KEY.encode(), b"\xc0\xaf" * 100):
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Authorization: " + value + b"\r\nContent-Length: " + str(len(body)).encode() +
                   b"\r\nConnection: close\r\n\r\n" + body)
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(request)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        status = int(reply.split(b" ", 2)[1])
        assert status in (400, 401), (value, reply[:300])
        assert b"Traceback" not in reply
    assert httpx.get(served.base_url + "/health").status_code == 200


def test_two_authorization_headers_are_401_and_good_key_still_works(served, client):
    before = _count_5xx(served)
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"authorization", b"Bearer other")]
    r = httpx.get(served.v1 + "/models", headers=headers)
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.v1, api_key=KEY + "x", max_retries=0).models.list()
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    assert _count_5xx(served) == before


def test_non_ascii_api_key_is_refused_at_start_up(tiny_checkpoint):
    from deepinfer.entrypoints.openai.app import build_app
    from deepinfer.errors import ConfigError

    with pytest.raises(ConfigError, match="ASCII"):
        build_app(make_engine(tiny_checkpoint, max_num_seqs=1), api_key="clé")


# ---------------------------------------------------------------- work caps

DEFAULT_CAPS = [
    ("completions", {"prompt": "hi", "n": 65, "max_tokens": 1} | {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": [[5, 6]] * 129, "max_tokens": 1}, "prompt"),
    ("chat/completions", {"messages": USER, "n": 129}, "n"),
    ("completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("completions", {"prompt": "hi", "stop": ["x" * 600, "y" * 600]}, "stop"),
    ("chat/completions", {"messages": USER, "stop": "z" * 1025}, "stop"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 2**63}, "max_tokens"),
    ("chat/completions", {"messages": USER, "max_completion_tokens": MAX_MODEL_LEN + 1}, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,param", DEFAULT_CAPS, ids=_ids(DEFAULT_CAPS))
def test_default_work_caps(served, path, body, param):
    r = httpx.post(f"{served.v1}/{path}", json={"model": MODEL, **body}, headers=AUTH, timeout=30)
    _assert_error(r, 400, param)


def test_at_the_default_caps_requests_pass(served, client):
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=1, stop=[f"s{i}" for i in range(16)],
                                  logprobs=20)
    assert r.usage.completion_tokens == 1
    r = client.completions.create(model=MODEL, prompt=["a", "b"], n=64, max_tokens=1)
    assert len(r.choices) == 128


CONFIGURED_CAPS = [
    ("completions", {"prompt": ["a", "b", "c"], "n": 2}, "prompt"),
    ("chat/completions", {"messages": USER, "n": 5}, "n"),
    ("completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop"),
    ("completions", {"prompt": "hi", "stop": "elevenchars"}, "stop"),
    ("completions", {"prompt": "hi", "logprobs": 4}, "logprobs"),
    ("chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 4}, "top_logprobs"),
    ("completions", {"prompt": "hi", "max_tokens": 9}, "max_tokens"),
    ("chat/completions", {"messages": USER, "max_completion_tokens": 9}, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,param", CONFIGURED_CAPS,
                         ids=_ids(CONFIGURED_CAPS))
def test_configured_work_caps(capped, path, body, param):
    r = httpx.post(f"{capped.v1}/{path}", json={"model": MODEL, **body}, timeout=30)
    err = _assert_error(r, 400, param)
    assert err["code"] == "limit_exceeded"


def test_configured_caps_allow_up_to_the_cap_and_bound_unset_max_tokens(capped):
    client = openai.OpenAI(base_url=capped.v1, api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=8, stop=["ab", "cd"], logprobs=3)
    assert len(r.choices) == 4
    # No max_tokens on chat (OpenAI: up to the context): the server's --max-output-tokens bounds it.
    r = client.chat.completions.create(model=MODEL, messages=USER, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_limits_validation_and_flags():
    import argparse

    from deepinfer.entrypoints.cli_serve import add_serve_arguments
    from deepinfer.entrypoints.openai.request_checks import ServerLimits
    from deepinfer.entrypoints.openai.server import limits_from_args
    from deepinfer.errors import ConfigError

    parser = add_serve_arguments(argparse.ArgumentParser())
    assert limits_from_args(parser.parse_args(["m"])) == ServerLimits()
    assert ServerLimits() == ServerLimits(128, 16, 1024, 20, None)
    args = parser.parse_args(["m", "--max-choices-per-request", "8", "--max-stop-strings", "4",
                              "--max-stop-chars", "64", "--max-logprobs", "5", "--max-output-tokens", "256",
                              "--no-access-log"])
    assert limits_from_args(args) == ServerLimits(8, 4, 64, 5, 256)
    assert args.no_access_log is True
    with pytest.raises(ConfigError, match="max-logprobs"):
        limits_from_args(parser.parse_args(["m", "--max-logprobs", "21"]))
    with pytest.raises(ConfigError, match="max-stop-strings"):
        limits_from_args(parser.parse_args(["m", "--max-stop-strings", "0"]))


# ---------------------------------------------------------------- fail closed

UNSUPPORTED = [
    # structured output and tools are implemented (tests/server/test_server_structured.py); their options are not:
    ("completions", {"prompt": "hi", "guided_regex": "a", "guided_decoding_backend": "outlines"},
     "guided_decoding_backend"),
    ("completions", {"prompt": "hi", "guided_json": {}, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("completions", {"prompt": "hi", "structured_outputs": {"json": {}, "structural_tag": "t"}}, "structured_outputs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 0}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "echo": True}, "echo"),
    ("completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "hi", "stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
    ("completions", {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options"),
    ("completions", {"prompt": "hi", "max_completion_tokens": 5}, "max_completion_tokens"),
    # this test model's tokenizer has no tool-call tokens
    ("chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat/completions", {"messages": USER, "tool_choice": "auto"}, "tool_choice"),
    ("chat/completions", {"messages": USER, "tool_choice": "none"}, "tool_choice"),
    ("chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ("chat/completions", {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat/completions", {"messages": USER, "prompt_logprobs": 2}, "prompt_logprobs"),
    ("chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
    ("chat/completions", {"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
    ("chat/completions", {"messages": USER, "continue_final_message": True}, "continue_final_message"),
]


@pytest.mark.parametrize("path,body,param", UNSUPPORTED, ids=_ids(UNSUPPORTED))
def test_unimplemented_features_fail_closed(served, path, body, param):
    r = httpx.post(f"{served.v1}/{path}", json={"model": MODEL, "max_tokens": 2, **body}, headers=AUTH, timeout=30)
    err = _assert_error(r, 400, param)
    assert "not supported" in err["message"] or "only allowed" in err["message"], err


def test_neutral_values_and_unknown_fields_pass_and_are_logged_at_debug(served, client, caplog):
    caplog.set_level(logging.DEBUG, logger="deepinfer.server")
    r = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, echo=False, logit_bias={}, user="u1",
        extra_body={"guided_json": None, "use_beam_search": False, "store": True, "metadata": {"a": "b"},
                    "totally_unknown_field": 3},
    )
    assert r.usage.completion_tokens >= 1
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, response_format={"type": "text"}, parallel_tool_calls=False,
        extra_body={"tools": [], "tool_choice": None, "another_unknown": "x"},
    )
    assert r.usage.completion_tokens >= 1
    ignored = [rec.getMessage() for rec in caplog.records if "ignoring request fields" in rec.getMessage()]
    assert any("totally_unknown_field" in m and "store" in m for m in ignored), ignored
    assert any("another_unknown" in m for m in ignored), ignored
    assert all(rec.levelno == logging.DEBUG for rec in caplog.records if "ignoring request fields" in rec.getMessage())


def test_fail_closed_through_the_official_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert info.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}})
    assert info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream_options={"include_usage": True})
    assert info.value.body["param"] == "stream_options"


# ---------------------------------------------------------------- no NaN / Infinity in JSON


def _vocab(served) -> int:
    return min(served.engine.tokenizer.vocab_size, served.engine.vocab_size)


def test_tiny_temperature_is_greedy_and_valid_json(served, client):
    kw = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "logprobs": 5}
    greedy = client.completions.create(temperature=0, extra_body={"ignore_eos": True}, **kw)
    for t in (1e-30, 1e-300, 5e-324, 1e-6):
        r = httpx.post(served.v1 + "/completions", headers=AUTH, timeout=60,
                       json={**kw, "ignore_eos": True, "temperature": t})
        assert r.status_code == 200, r.text
        body = strict_json(r.text)
        assert body["choices"][0]["text"] == greedy.choices[0].text, t
        assert all(math.isfinite(x) for x in body["choices"][0]["logprobs"]["token_logprobs"])
    stream = client.chat.completions.create(model=MODEL, messages=USER, temperature=1e-30, max_tokens=6, logprobs=True,
                                            top_logprobs=5, stream=True, extra_body={"ignore_eos": True})
    assert sum(len(c.logprobs.content) for ch in stream for c in ch.choices if c.logprobs) == 6


def _masking_body(served, **kw):
    """min_tokens + stop_token_ids covering most of the vocabulary: those tokens have logit -inf
    while min_tokens holds, so the top-20 candidates include -inf log-probabilities."""
    banned = [i for i in range(5, _vocab(served)) if not 100 <= i < 110]
    return {"model": MODEL, "max_tokens": 3, "min_tokens": 3, "stop_token_ids": banned, "temperature": 1e-30,
            "ignore_eos": True, **kw}


def _sse_events(r) -> list[str]:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_minus_inf_logprobs_are_written_as_the_finite_sentinel(served):
    from deepinfer.entrypoints.openai.serving_output import LOGPROB_FLOOR

    assert LOGPROB_FLOOR == -9999.0
    body = _masking_body(served, prompt="hi", logprobs=20)
    r = httpx.post(served.v1 + "/completions", headers=AUTH, timeout=60, json=body)
    assert r.status_code == 200, r.text
    lp = strict_json(r.text)["choices"][0]["logprobs"]
    values = [v for top in lp["top_logprobs"] for v in top.values()]
    assert LOGPROB_FLOOR in values and all(math.isfinite(v) for v in values)
    assert all(math.isfinite(v) and v > LOGPROB_FLOOR for v in lp["token_logprobs"])  # drawn tokens were allowed

    body = _masking_body(served, messages=USER, logprobs=True, top_logprobs=20)
    r = httpx.post(served.v1 + "/chat/completions", headers=AUTH, timeout=60, json=body)
    assert r.status_code == 200, r.text
    content = strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert any(t["logprob"] == LOGPROB_FLOOR for item in content for t in item["top_logprobs"])

    for path, extra in (("completions", {"prompt": "hi", "logprobs": 20}),
                        ("chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 20})):
        with httpx.stream("POST", f"{served.v1}/{path}", headers=AUTH, timeout=60,
                          json=_masking_body(served, stream=True, **extra)) as r:
            events = _sse_events(r)
        assert events[-1] == "[DONE]"
        chunks = [strict_json(e) for e in events[:-1]]
        assert "-9999.0" in "".join(events) and not any("error" in c for c in chunks)


def test_nan_never_reaches_json_it_is_an_error(served):
    """A NaN log-probability is a bug: serialization refuses it (a 500 / an in-band error event),
    never an invalid `NaN` in a body; the other requests are unaffected."""
    from deepinfer.entrypoints.openai.serving_output import dumps, sse

    with pytest.raises(ValueError):
        dumps({"x": float("nan")})
    with pytest.raises(ValueError):
        sse({"x": float("inf")})

    engine = served.engine
    original = engine.output_processor.append_token

    def poison(seq, token_id, logprobs):
        if "inject-nan" in seq.request.request_id and logprobs:
            for lp in logprobs.values():
                lp.logprob = float("nan")
        return original(seq, token_id, logprobs)

    engine.output_processor.append_token = poison
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "logprobs": 2}
        r = httpx.post(served.v1 + "/completions", json=body, timeout=60,
                       headers={**AUTH, "X-Request-Id": "inject-nan-1"})
        assert r.status_code == 500 and "NaN" not in r.text
        assert r.json()["error"]["code"] == "internal_error"
        with httpx.stream("POST", served.v1 + "/completions", json={**body, "stream": True}, timeout=60,
                          headers={**AUTH, "X-Request-Id": "inject-nan-2"}) as r:
            assert r.status_code == 200
            events = _sse_events(r)
        assert "NaN" not in "".join(events)
        assert events[-1] == "[DONE]" and "error" in strict_json(events[-2])
        ok = httpx.post(served.v1 + "/completions", json=body, timeout=60, headers=AUTH)
        assert ok.status_code == 200 and strict_json(ok.text)["choices"][0]["logprobs"]
    finally:
        engine.output_processor.append_token = original


# ---------------------------------------------------------------- the server keeps serving


def test_bad_inputs_concurrently_with_good_streams(served):
    before = _count_5xx(served)
    bad = [(p, b) for p, b, _ in SURROGATE_BODIES[:4]] + [
        ("completions", json.dumps({"model": MODEL, "prompt": "hi", "top_k": 2**63}).encode()),
        ("completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}'),
        ("completions", b'{"model": "tiny", "prompt": "hi", "top_p": -Infinity}'),
        ("completions", b'{"model": "tiny", "prompt": "hi", "presence_penalty": 1e999}'),
        ("chat/completions", json.dumps({"model": MODEL, "messages": USER, "guided_regex": "("}).encode()),
        ("chat/completions", json.dumps({"model": MODEL, "messages": USER, "n": 1000}).encode()),
    ]

    async def good(c, i):
        body = {"model": MODEL, "prompt": f"good stream {i}", "max_tokens": 12, "ignore_eos": True, "stream": True,
                "temperature": 0}
        async with c.stream("POST", served.v1 + "/completions", json=body) as r:
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        chunks = [strict_json(e[6:]) for e in events[:-1]]
        assert [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]] == ["length"]

    async def one_bad(c, path, raw):
        r = await c.post(f"{served.v1}/{path}", content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500 and "error" in r.json(), (raw[:80], r.status_code, r.text)

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
            await asyncio.gather(*(good(c, i) for i in range(4)), *(one_bad(c, p, b) for p, b in bad * 2))

    asyncio.run(main())
    assert _count_5xx(served) == before
