"""The server's contract (issue 11, item 8): /openapi.json says what the server does (400 not 422,
/metrics as text/plain, every status with the error schema, the server's own limits), 405 carries
`Allow`, HEAD is answered wherever GET is, GET /v1/models/{model}, POST /tokenize and /detokenize
(vLLM's shapes, the same checks as the completion endpoints), chat logprobs `bytes` are the token's
raw bytes, the empty-prompt behaviour of docs/serving.md, and integer fields taking 2.0.

A real server on loopback (`deepinfer serve`'s uvicorn config), driven by the official `openai`
client and raw httpx.
"""

from __future__ import annotations

import json

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
from server_harness import MAX_MODEL_LEN, make_engine, start_production_server  # noqa: E402

MODEL = "tiny"
OTHER = "deepinfer/tiny-v2"  # a second served name, with a slash
KEY = "contract-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Hello there"}]
GET_PATHS = ["/health", "/version", "/metrics", "/v1/models", f"/v1/models/{MODEL}", f"/v1/models/{OTHER}",
             "/openapi.json"]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, max_num_seqs=8)
    live = start_production_server(engine, served_model_name=[MODEL, OTHER], api_key=KEY)
    live.engine = engine
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def spec(served):
    r = httpx.get(served.base_url + "/openapi.json")
    assert r.status_code == 200
    return r.json()


def _error(r, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---------------------------------------------------------------- /openapi.json


def test_openapi_documents_400_not_422_and_every_status_with_the_error_schema(spec):
    text = json.dumps(spec)
    assert '"422"' not in text and "HTTPValidationError" not in text
    error_ref = "#/components/schemas/ErrorResponse"
    assert set(spec["components"]["schemas"]["ErrorResponse"]["properties"]) == {"error"}
    posts = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for path in posts:
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "408", "413", "431", "500", "503"} <= set(responses), (path, responses)
        for status in ("400", "401", "404", "413", "431", "500", "503"):
            assert responses[status]["content"]["application/json"]["schema"]["$ref"] == error_ref, (path, status)
        assert spec["paths"][path]["post"]["security"] == [{"bearerAuth": []}]
        assert spec["paths"][path]["post"]["requestBody"]["required"] is True
    for path in ("/v1/completions", "/v1/chat/completions"):  # streamed: an event schema
        assert "text/event-stream" in spec["paths"][path]["post"]["responses"]["200"]["content"]
    assert spec["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
    assert "404" in spec["paths"]["/v1/models/{model}"]["get"]["responses"]
    assert "security" not in spec["paths"]["/health"]["get"]
    assert "401" not in spec["paths"]["/health"]["get"]["responses"]
    health = spec["paths"]["/health"]["get"]["responses"]
    assert health["503"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/HealthStatus"
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    for path, item in spec["paths"].items():  # HEAD wherever GET, same statuses, no body
        if "get" in item:
            assert set(item["head"]["responses"]) == set(item["get"]["responses"]), path
            assert not any("content" in r for r in item["head"]["responses"].values()), path
            assert item["head"]["operationId"] != item["get"]["operationId"]


def test_openapi_request_schemas_carry_the_servers_limits(spec, served):
    schemas = spec["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert completion["model"]["anyOf"][0]["enum"] == [MODEL, OTHER]
    assert completion["n"]["maximum"] == 128 and completion["n"]["minimum"] == 1
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN - 1
    assert completion["max_tokens"]["default"] == 16
    assert completion["logprobs"]["anyOf"][0]["maximum"] == 20
    assert chat["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert completion["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 100.0}
    assert completion["top_p"]["anyOf"][0]["exclusiveMinimum"] == 0
    assert completion["stop"]["anyOf"][1]["maxItems"] == 16
    vocab = served.engine.tokenizer.vocab_size
    ids = completion["prompt"]["anyOf"][2]
    assert ids["items"]["maximum"] == vocab - 1 and ids["minItems"] == 1 and ids["maxItems"] == MAX_MODEL_LEN - 1
    assert completion["echo"]["enum"] == [False]
    assert chat["tool_choice"]["type"] == "null"
    roles = schemas["ChatMessage"]["properties"]["role"]["enum"]
    assert "user" in roles and "tool" not in roles  # the test template refuses `tool`
    tokenize = spec["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {s["$ref"].rsplit("/", 1)[1] for s in tokenize["anyOf"]} == {"TokenizeCompletionRequest",
                                                                          "TokenizeChatRequest"}


def test_openapi_without_an_api_key_documents_no_401(tiny_checkpoint):
    live = start_production_server(make_engine(tiny_checkpoint, max_num_seqs=1), served_model_name=MODEL)
    try:
        spec = httpx.get(live.base_url + "/openapi.json").json()
    finally:
        live.stop()
    assert "securitySchemes" not in spec["components"]
    for item in spec["paths"].values():
        for op in item.values():
            assert "401" not in op["responses"] and "security" not in op


def test_validation_errors_are_400_with_the_openai_body(served):
    for body in ({"model": MODEL, "prompt": 12}, {"model": MODEL, "prompt": "hi", "n": "two"}, {}):
        r = httpx.post(served.v1 + "/completions", json=body, headers=AUTH)
        _error(r, 400)
    r = httpx.post(served.base_url + "/tokenize", content=b"{nope",
                   headers={**AUTH, "content-type": "application/json"})
    _error(r, 400, "body", "invalid_json")


# ---------------------------------------------------------------- 405 + Allow, HEAD


def test_405_carries_allow(served):
    for method, path, allow in (("PUT", "/v1/completions", {"POST"}), ("DELETE", "/v1/chat/completions", {"POST"}),
                                ("GET", "/tokenize", {"POST"}), ("POST", "/health", {"GET", "HEAD"}),
                                ("PATCH", "/v1/models", {"GET", "HEAD"}), ("POST", "/metrics", {"GET", "HEAD"})):
        r = httpx.request(method, served.base_url + path, headers=AUTH)
        err = _error(r, 405, None, "method_not_allowed")
        assert {m.strip() for m in r.headers["allow"].split(",")} == allow, (method, path, r.headers)
        assert err["message"]


def test_head_is_answered_wherever_get_is(served):
    with httpx.Client(headers=AUTH, timeout=30) as c:
        for path in GET_PATHS:
            g, h = c.get(served.base_url + path), c.head(served.base_url + path)
            assert g.status_code == h.status_code == 200, (path, g.status_code, h.status_code)
            assert h.content == b""
            assert h.headers["content-type"] == g.headers["content-type"], path
            if path not in ("/metrics", "/v1/models", f"/v1/models/{MODEL}", f"/v1/models/{OTHER}"):
                assert h.headers["content-length"] == g.headers["content-length"], path  # (`created` changes)
        h = c.head(served.v1 + "/models/nope")
        assert h.status_code == 404 and h.content == b""
    assert httpx.head(served.v1 + "/models").status_code == 401  # HEAD needs the key as GET does


# ---------------------------------------------------------------- GET /v1/models/{model}


def test_get_one_model(served, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(OTHER).id == OTHER
    assert [m.id for m in client.models.list().data] == [MODEL, OTHER]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    _error(httpx.get(served.v1 + "/models/no-such-model", headers=AUTH), 404, "model", "model_not_found")
    _error(httpx.get(served.v1 + f"/models/{MODEL}"), 401, None, "invalid_api_key")


# ---------------------------------------------------------------- /tokenize, /detokenize


def test_tokenize_gives_the_ids_the_completion_endpoints_use(served, client):
    tok = served.engine.tokenizer
    text = "Hello 😀 world, 你好"

    def tokenize(**body):
        r = httpx.post(served.base_url + "/tokenize", json={"model": MODEL, **body}, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    out = tokenize(prompt=text)
    assert set(out) == {"count", "max_model_len", "tokens"}
    assert out["tokens"] == tok.encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == MAX_MODEL_LEN
    usage = client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == out["count"]
    out = tokenize(prompt=text, return_token_strs=True)
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    assert tokenize(prompt=text, add_special_tokens=False)["tokens"] == tok.encode(text, add_special_tokens=False)
    assert tokenize(prompt="")["tokens"] == tok.encode("")  # BOS alone (docs/serving.md: empty prompts)

    chat = tokenize(messages=USER)
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(USER, add_generation_prompt=True))
    usage = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1).usage
    assert usage.prompt_tokens == chat["count"]
    no_prompt = tokenize(messages=USER, add_generation_prompt=False)
    assert no_prompt["tokens"] == tok.encode(tok.apply_chat_template(USER, add_generation_prompt=False))
    assert no_prompt["count"] < chat["count"]
    assert tokenize(model=None, messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]) \
        == chat

    def detokenize(tokens):
        r = httpx.post(served.base_url + "/detokenize", json={"model": OTHER, "tokens": tokens}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert set(r.json()) == {"prompt"}
        return r.json()["prompt"]

    ids = tok.encode(text)
    assert detokenize(ids) == tok.decode(ids, skip_special_tokens=False)  # special tokens included, as vLLM's
    assert detokenize(tok.encode(text, add_special_tokens=False)) == text
    assert detokenize([]) == ""
    assert detokenize([float(i) for i in ids[:3]]) == tok.decode(ids[:3], skip_special_tokens=False)


TOKENIZE_BAD = [
    ("/tokenize", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, "prompt", "invalid_unicode"),
    ("/tokenize", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages",
     "invalid_unicode"),
    ("/tokenize", b'{"model": "tiny\\ud800", "prompt": "hi"}', 400, "model", "invalid_unicode"),
    ("/detokenize", b'{"model": "tiny", "tokens": [1], "extra": "\\ud800"}', 400, "extra", "invalid_unicode"),
    ("/tokenize", b'{"model": "gpt-4", "prompt": "hi"}', 404, "model", "model_not_found"),
    ("/detokenize", b'{"model": "gpt-4", "tokens": [1]}', 404, "model", "model_not_found"),
    ("/tokenize", b'{"model": "tiny", "prompt": "hi", "messages": []}', 400, "prompt", None),
    ("/tokenize", b'{"model": "tiny"}', 400, "prompt", "missing_required_parameter"),
    ("/tokenize", b'{"model": "tiny", "prompt": 5}', 400, "prompt", None),
    ("/tokenize", b'{"model": "tiny", "messages": []}', 400, "messages", None),
    ("/tokenize", b'{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages", None),
    ("/tokenize", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                  b'"continue_final_message": true}', 400, "continue_final_message", "unsupported_parameter"),
    ("/tokenize", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "add_special_tokens": true}',
     400, "add_special_tokens", "unsupported_parameter"),
    ("/tokenize", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template": "x"}',
     400, "chat_template", "unsupported_parameter"),
    ("/tokenize", b'[1, 2]', 400, "body", None),
    ("/detokenize", b'{"model": "tiny", "tokens": [1, 99999]}', 400, "tokens", None),
    ("/detokenize", b'{"model": "tiny", "tokens": [-1]}', 400, "tokens", None),
    ("/detokenize", b'{"model": "tiny", "tokens": ["a"]}', 400, "tokens", None),
    ("/detokenize", b'{"model": "tiny", "tokens": [1.5]}', 400, "tokens", None),
    ("/detokenize", b'{"model": "tiny"}', 400, "tokens", "missing_required_parameter"),
    ("/detokenize", json.dumps({"model": "tiny", "tokens": [5] * (MAX_MODEL_LEN + 1)}).encode(), 400, "tokens",
     "limit_exceeded"),
    ("/tokenize", json.dumps({"model": "tiny", "prompt": "word " * 3000}).encode(), 400, "prompt",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("path,raw,status,param,code", TOKENIZE_BAD,
                         ids=[f"{p}-{q}-{i}" for i, (p, _, _, q, _) in enumerate(TOKENIZE_BAD)])
def test_tokenize_detokenize_refuse_bad_input_as_the_other_endpoints(served, path, raw, status, param, code):
    r = httpx.post(served.base_url + path, content=raw, headers={**AUTH, "content-type": "application/json"})
    err = _error(r, status, param, code)
    assert "Traceback" not in r.text and err["message"]


def test_tokenize_detokenize_need_the_api_key(served):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + KEY}):
            _error(httpx.post(served.base_url + path, json=body, headers=headers), 401, None, "invalid_api_key")


# ---------------------------------------------------------------- chat logprobs: raw token bytes


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table, the alphabet of byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _raw_bytes(tokenizer_json: dict, token_id: int) -> bytes:
    inverse = {v: k for k, v in tokenizer_json["model"]["vocab"].items()}
    decoder = {c: b for b, c in _gpt2_bytes_to_unicode().items()}
    return bytes(decoder[c] for c in inverse[token_id])


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(served, tiny_checkpoint):
    import os

    with open(os.path.join(tiny_checkpoint, "tokenizer.json"), encoding="utf-8") as f:
        tokenizer_json = json.load(f)
    tok = served.engine.tokenizer
    emoji = "😀"
    pieces = tok.encode(emoji, add_special_tokens=False)
    assert len(pieces) > 1, "the test needs a character split over several tokens"
    raw = {i: _raw_bytes(tokenizer_json, i) for i in pieces}
    assert b"".join(raw[i] for i in pieces) == emoji.encode("utf-8")
    assert all(tok.token_text(i) == "\ufffd" for i in pieces)  # each piece alone decodes to U+FFFD
    # Only the emoji's pieces can be drawn (the others are stop tokens, masked while min_tokens holds).
    vocab = min(tok.vocab_size, served.engine.vocab_size)
    banned = [i for i in range(vocab) if i not in raw]
    body = {"model": MODEL, "messages": USER, "max_tokens": 6, "min_tokens": 6, "stop_token_ids": banned,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}
    for stream in (False, True):
        if stream:
            with httpx.stream("POST", served.v1 + "/chat/completions", json={**body, "stream": True}, headers=AUTH,
                              timeout=60) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            content = [t for ev in events for c in ev["choices"] if c.get("logprobs") for t in c["logprobs"]["content"]]
        else:
            r = httpx.post(served.v1 + "/chat/completions", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
            content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 6
        for item in content:
            assert bytes(item["bytes"]) in raw.values(), item  # a raw piece, never the UTF-8 of U+FFFD
            assert item["token"] == "\ufffd"
            finite = {bytes(t["bytes"]) for t in item["top_logprobs"] if t["logprob"] > -9999}
            assert finite == set(raw.values()), item["top_logprobs"]  # every drawable piece, by its raw bytes
    # A client rebuilds the character from the pieces' bytes, in the tokenizer's order.
    by_bytes = {bytes(t["bytes"]) for t in content[0]["top_logprobs"]}
    assert b"".join(raw[i] for i in pieces if raw[i] in by_bytes).decode("utf-8") == emoji
    # Whole-character tokens: bytes == UTF-8 of the text; special tokens too.
    r = httpx.post(served.v1 + "/chat/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "messages": USER, "max_tokens": 4, "logprobs": True, "top_logprobs": 5})
    for item in r.json()["choices"][0]["logprobs"]["content"]:
        for t in [item, *item["top_logprobs"]]:
            if "\ufffd" not in t["token"]:
                assert bytes(t["bytes"]) == t["token"].encode("utf-8"), t


# ---------------------------------------------------------------- empty prompts, integral numbers


def test_empty_prompts_as_documented(served, client):
    """docs/serving.md: an empty text prompt is the BOS token alone (when the tokenizer adds one), so it
    is served; an empty token list, an empty list of prompts or an empty message list is a 400."""
    r = client.completions.create(model=MODEL, prompt="", max_tokens=2)
    assert r.usage.prompt_tokens == 1 and r.usage.completion_tokens >= 1
    r = client.completions.create(model=MODEL, prompt=["", "x"], max_tokens=1)
    assert len(r.choices) == 2
    for prompt in ([], [[]], [[5], []]):
        _error(httpx.post(served.v1 + "/completions", json={"model": MODEL, "prompt": prompt}, headers=AUTH), 400,
               "prompt")
    _error(httpx.post(served.v1 + "/chat/completions", json={"model": MODEL, "messages": []}, headers=AUTH), 400,
           "messages")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ""}], max_tokens=1)
    assert r.usage.prompt_tokens >= 1


def test_integer_fields_take_integral_json_numbers(served):
    """JSON Schema's `integer` (what /openapi.json says) is a number without a fractional part: 2.0 is 2."""
    r = httpx.post(served.v1 + "/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "prompt": [5.0, 6, 7.0], "n": 2.0, "max_tokens": 3.0, "logprobs": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["prompt_tokens"] == 3
    for field, value in (("n", 2.5), ("max_tokens", 1e400), ("n", True), ("max_tokens", "3")):
        raw = json.dumps({"model": MODEL, "prompt": "hi", field: value}).encode().replace(b"Infinity", b"1e400")
        r = httpx.post(served.v1 + "/completions", content=raw, headers={**AUTH, "content-type": "application/json"})
        _error(r, 400, field)
