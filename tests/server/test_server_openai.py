"""The OpenAI-compatible server driven by the official `openai` client over loopback, on a tiny CPU model."""

from __future__ import annotations

import asyncio
import json

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
from server_harness import MAX_MODEL_LEN, collect_stream, make_engine, read_metric, start_server, wait_for

MODEL = "tiny"
PROMPTS = [f"Prompt number {i}: the quick brown fox" + " jumps" * (i % 5) for i in range(16)]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    """References from the engine's own Python API first, then the same engine behind the server."""
    engine = make_engine(tiny_checkpoint)
    refs = engine.generate(PROMPTS, use_tqdm=False, **GREEDY)
    chat_ref = engine.chat(CHAT, use_tqdm=False, **GREEDY)[0]
    live = start_server(engine, served_model_name=MODEL)
    live.refs = {p: r for p, r in zip(PROMPTS, refs)}
    live.chat_ref = chat_ref
    live.engine = engine
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60)


def _extra(**kw):
    return {"extra_body": kw} if kw else {}


def test_models_health_version_metrics(served, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(served.base_url + "/health").json()["status"] == "ok"
    import deepinfer

    assert httpx.get(served.base_url + "/version").json() == {"version": deepinfer.__version__}
    text = httpx.get(served.base_url + "/metrics").text
    for name in (
        "deepinfer_num_requests_running",
        "deepinfer_num_requests_waiting",
        "deepinfer_kv_cache_usage_ratio",
        "deepinfer_prompt_tokens_total",
        "deepinfer_generation_tokens_total",
        "deepinfer_time_to_first_token_seconds_count",
        "deepinfer_inter_token_latency_seconds_count",
        "deepinfer_e2e_request_latency_seconds_count",
    ):
        assert read_metric(text, name) is not None, name


def test_greedy_completion_equals_engine_generate(served, client):
    prompt = PROMPTS[3]
    ref = served.refs[prompt]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, **_extra(ignore_eos=True))
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(ref.prompt_token_ids) + 12


def test_token_id_prompt_and_prompt_list(served, client):
    a, b = PROMPTS[0], PROMPTS[1]
    ids = served.refs[a].prompt_token_ids
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12, **_extra(ignore_eos=True))
    assert r.choices[0].text == served.refs[a].text
    r = client.completions.create(model=MODEL, prompt=[a, b], temperature=0, max_tokens=12, **_extra(ignore_eos=True))
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [served.refs[a].text, served.refs[b].text]


def test_streamed_completion_equals_non_streamed_and_counts_usage(served, client):
    prompt = PROMPTS[5]
    stream = client.completions.create(
        model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, temperature=0, max_tokens=12,
        **_extra(ignore_eos=True),
    )
    chunks = list(stream)
    text = "".join(c.text for ch in chunks for c in ch.choices)
    assert text == served.refs[prompt].text
    finals = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(served.refs[prompt].prompt_token_ids)
    assert all(ch.usage is None for ch in chunks[:-1])


def test_sse_wire_format_ends_with_done(served):
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", served.v1 + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert json.loads(line[6:])["object"] == "text_completion"


def test_chat_streamed_and_not_equal_engine_chat(served, client):
    ref = served.chat_ref
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12, **_extra(ignore_eos=True))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=12, stream=True,
        stream_options={"include_usage": True}, **_extra(ignore_eos=True),
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert text == ref.text
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + 12


def test_n2_and_seeded_requests_are_reproducible(served, client):
    kw = dict(model=MODEL, prompt=PROMPTS[7], n=2, temperature=1.0, max_tokens=10, seed=1234)
    a = client.completions.create(**kw, **_extra(ignore_eos=True))
    b = client.completions.create(**kw, **_extra(ignore_eos=True))
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 20
    others = [
        client.completions.create(**{**kw, "seed": s}, **_extra(ignore_eos=True)).choices[0].text for s in (1, 2, 3)
    ]
    assert any(t != a.choices[0].text for t in others), "different seeds gave identical samples"
    chat_kw = dict(model=MODEL, messages=CHAT, n=2, temperature=0.9, top_p=0.9, presence_penalty=0.5,
                   frequency_penalty=0.5, max_tokens=8, seed=7)
    extra = _extra(top_k=50, min_p=0.01, repetition_penalty=1.1, ignore_eos=True)
    c1 = client.chat.completions.create(**chat_kw, **extra)
    c2 = client.chat.completions.create(**chat_kw, **extra)
    assert len(c1.choices) == 2
    assert [c.message.content for c in c1.choices] == [c.message.content for c in c2.choices]
    assert c1.usage.completion_tokens == 16


def test_completion_logprobs(served, client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[4], temperature=0, max_tokens=6, logprobs=3,
                                  **_extra(ignore_eos=True))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(isinstance(t, str) and t for t in lp.tokens)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely (<= because byte pieces that decode alike share a key)
        assert chosen >= max(top.values()) - 1e-5


def test_chat_logprobs(served, client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=5, logprobs=True,
                                       top_logprobs=2, **_extra(ignore_eos=True))
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=5, logprobs=True,
                                            top_logprobs=2, stream=True, **_extra(ignore_eos=True))
    streamed = [t for ch in stream for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_stop_strings(served, client):
    prompt = PROMPTS[9]
    full = served.refs[prompt].text
    stop = next((full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip()), None)
    assert stop is not None, f"the fixed-seed reference text {full!r} has no usable stop string: pick another prompt"
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=[stop],
                                  **_extra(ignore_eos=True))
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=stop,
                                       stream=True, **_extra(ignore_eos=True))
    assert "".join(c.text for ch in stream for c in ch.choices) == expected


def test_sixteen_concurrent_streams_are_complete_and_correct(served):
    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, temperature=0, max_tokens=12,
                                                 extra_body={"ignore_eos": True})
        return await collect_stream(stream)

    async def run_all():
        async with openai.AsyncOpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    before = httpx.get(served.base_url + "/metrics").text
    results = asyncio.run(run_all())
    for prompt, (text, reasons) in zip(PROMPTS, results):
        assert reasons == ["length"]
        assert text == served.refs[prompt].text, prompt
    after = httpx.get(served.base_url + "/metrics").text

    def grew(name, labels=None):
        return (read_metric(after, name, labels) or 0) - (read_metric(before, name, labels) or 0)

    assert grew("deepinfer_time_to_first_token_seconds_count") == 16
    assert grew("deepinfer_e2e_request_latency_seconds_count") == 16
    assert grew("deepinfer_inter_token_latency_seconds_count") >= 16 * 11
    assert grew("deepinfer_generation_tokens_total") == 16 * 12
    assert grew("deepinfer_prompt_tokens_total") == sum(len(served.refs[p].prompt_token_ids) for p in PROMPTS)
    assert grew("deepinfer_requests_finished_total", 'finish_reason="length"') == 16
    assert grew("deepinfer_http_responses_total", 'endpoint="/v1/completions",status="200"') == 16


def test_client_disconnect_mid_stream_frees_blocks(served):
    def metrics():
        return httpx.get(served.base_url + "/metrics").text

    assert wait_for(lambda: read_metric(metrics(), "deepinfer_kv_blocks_used") == 0)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_MODEL_LEN - 64, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", served.v1 + "/completions", json=body, timeout=60) as r:
        seen = 0
        lines = r.iter_lines()
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 3:
                break
        # Still inside the stream (the generator is open): the request holds KV blocks.
        assert read_metric(metrics(), "deepinfer_kv_blocks_used") > 0
        assert served.async_engine.num_in_flight == 1
        lines.close()  # closing the iterator closes the response: the client disconnects mid-stream
    # The stream is closed early: the server aborts the request and its blocks go back to the pool.
    assert wait_for(lambda: served.async_engine.num_in_flight == 0)
    assert wait_for(lambda: read_metric(metrics(), "deepinfer_kv_blocks_used") == 0)
    assert wait_for(lambda: read_metric(metrics(), "deepinfer_requests_finished_total", 'finish_reason="abort"'))
    assert served.engine.stats().kv_blocks_used == 0 or wait_for(lambda: served.async_engine.snapshot.stats.kv_blocks_used == 0)


def test_non_streaming_client_timeout_aborts_request(served):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.v1 + "/completions", json=body, timeout=0.2)
    assert wait_for(lambda: served.async_engine.num_in_flight == 0)
    assert wait_for(lambda: served.async_engine.snapshot.stats.kv_blocks_used == 0)


LONG_IDS = [5] * (MAX_MODEL_LEN + 8)

BAD_INPUTS = [
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 5}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("completions", {"prompt": "hi", "presence_penalty": 9}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "frequency_penalty": "x"}, 400, "frequency_penalty"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "n": True}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 10**9}, 400, "n"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN * 4}, 400, "max_tokens"),
    ("completions", {"prompt": LONG_IDS, "max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": [10**9], "max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": [], "max_tokens": 4}, 400, "prompt"),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": 12}, 400, "prompt"),
    ("completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "seed": "abc"}, 400, "seed"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_MODEL_LEN * 4}, 400,
     "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99}, 400,
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS, ids=[f"{p}-{q}-{i}" for i, (p, _, _, q) in enumerate(BAD_INPUTS)])
def test_bad_input_gets_status_and_names_field(served, path, body, status, param):
    body = {"model": MODEL, **body} if "model" not in body else body
    r = httpx.post(f"{served.v1}/{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert param in err["message"], err


def test_malformed_and_oversize_bodies_then_keeps_serving(served, client):
    r = httpx.post(served.v1 + "/completions", content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    for raw in (b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}'):
        r = httpx.post(served.v1 + "/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("temperature", "top_p"), r.text
    r = httpx.post(served.v1 + "/completions", content=b"x" * (9 * 1024 * 1024), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
    assert httpx.get(served.v1 + "/nope").status_code == 404
    # The official client sees OpenAI exception types for these statuses.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")
    r = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=3)
    assert r.usage.completion_tokens >= 1
    text = httpx.get(served.base_url + "/metrics").text
    assert read_metric(text, "deepinfer_http_responses_total", 'endpoint="/v1/completions",status="500"') is None
