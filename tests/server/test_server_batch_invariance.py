"""1,000 identical concurrent completions at T=0 through the server, batch_invariant on: one unique answer
(text and logprobs), however the scheduler batched them."""

from __future__ import annotations

import asyncio

import httpx
from server_harness import make_engine, start_server


def test_thousand_identical_concurrent_requests_give_one_answer(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, batch_invariant=True, max_num_seqs=256, max_model_len=256)
    server = start_server(engine, served_model_name="tiny")
    body = {"model": "tiny", "prompt": "The engine computes the next token", "max_tokens": 4, "temperature": 0,
            "logprobs": 2}

    async def run() -> list[dict]:
        # one connection per request: none sits idle past the server's keep-alive timeout and gets reused
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.v1, timeout=300, limits=limits) as client:
            async def one():
                r = await client.post("/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]
            return await asyncio.gather(*(one() for _ in range(1000)))

    try:
        choices = asyncio.run(run())
    finally:
        server.stop()
    answers = {(c["text"], str(c["logprobs"]["token_logprobs"]), str(c["logprobs"]["top_logprobs"])) for c in choices}
    assert len(choices) == 1000 and len(answers) == 1, len(answers)
    assert engine.stats().num_requests_finished >= 1000
