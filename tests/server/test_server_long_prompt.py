"""A long prompt that fits is tokenized without pausing the event loop (issue 11, item 3).

The `tokenizers` library holds the GIL in `Tokenizer.encode` (~0.15 s for 200K characters on the
development machine), so tokenizing a long prompt on a worker thread used to pause the event loop
for that long; DeepInfer's Tokenizer encodes long texts with the batch call, which releases it.
A server whose context admits a 200K-character prompt (a copy of the tiny checkpoint with a longer
max_position_embeddings) tokenizes it fully (/tokenize, and a completion refused only after the
whole prompt is tokenized) while /health keeps answering in < 100 ms; the ids are the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
from server_harness import assert_responsive, health_latencies, make_engine, start_production_server  # noqa: E402

MODEL = "tiny"
LONG_LEN = 65536
TEXT = ("hello world " * 17_000)[:200_000]  # 200K characters, ~33K tokens: fits LONG_LEN


@pytest.fixture(scope="module")
def long_checkpoint(tiny_checkpoint, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("long_ckpt") / "tiny-long")
    shutil.copytree(tiny_checkpoint, path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["max_position_embeddings"] = LONG_LEN
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def served(long_checkpoint):
    engine = make_engine(long_checkpoint, max_model_len=LONG_LEN, max_num_seqs=2)
    live = start_production_server(engine, served_model_name=MODEL)
    live.engine = engine
    yield live
    live.stop()


def test_long_texts_encode_to_the_same_ids_through_the_gil_free_call(tiny_checkpoint):
    from deepinfer.text import tokenizer as tokenizer_module
    from deepinfer.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_checkpoint)
    threshold = tokenizer_module._GIL_FREE_ENCODE_CHARS
    samples = [TEXT, "你好世界，" * 3000, "😀 emoji\n\t " * 2000, "x" * 50_000,
               "<｜User｜>hi<｜Assistant｜>" * 1000, "mixed 数据 text 😀 " * 1000]
    for text in samples:
        assert len(text) > threshold
        plain = tok._tok.encode(text, add_special_tokens=False).ids  # the library's plain call
        assert tok.encode(text, add_special_tokens=False) == plain
        assert tok.encode(text) == [tok.bos_token_id, *plain]
    short = "short text"
    assert tok.encode(short, add_special_tokens=False) == tok._tok.encode(short, add_special_tokens=False).ids


def test_health_stays_fast_while_a_long_fitting_prompt_is_tokenized(served):
    expected = served.engine.tokenizer.encode(TEXT)
    assert 20_000 < len(expected) < LONG_LEN
    tokenize = json.dumps({"model": MODEL, "prompt": TEXT}).encode()
    # fits the context alone, not with max_tokens: refused only once the whole prompt is tokenized
    too_long = json.dumps({"model": MODEL, "prompt": TEXT, "max_tokens": LONG_LEN - len(expected) + 10}).encode()
    headers = {"content-type": "application/json"}

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            stop = asyncio.Event()

            def health():
                return health_latencies(c, served.base_url, stop)

            poll = asyncio.ensure_future(health())
            await asyncio.sleep(0.05)
            replies = []
            for _ in range(2):
                replies += await asyncio.gather(
                    c.post(served.base_url + "/tokenize", content=tokenize, headers=headers),
                    c.post(served.base_url + "/tokenize", content=tokenize, headers=headers),
                    c.post(served.v1 + "/completions", content=too_long, headers=headers),
                )
            stop.set()
            return replies, await poll

    replies, latencies = asyncio.run(main())
    for r in replies:
        if r.request.url.path == "/tokenize":
            assert r.status_code == 200, r.text[:300]
            assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
        else:
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
            assert f"{len(expected)} in the prompt" in err["message"]
    assert len(latencies) >= 5
    assert_responsive(latencies)
