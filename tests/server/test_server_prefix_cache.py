"""Prefix caching through the server: usage.prompt_tokens_details.cached_tokens (the official openai client
reads it) and the prefix-cache counters in /metrics."""

from __future__ import annotations

import httpx
import openai
from server_harness import make_engine, read_metric, start_server

PROMPT = "The engine computes the next token for every request in the batch, one step at a time, " * 4


def test_cached_tokens_in_usage_and_metrics(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, max_model_len=512)
    server = start_server(engine, served_model_name="tiny")
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0)
        first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
        second = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < second.usage.prompt_tokens and cached % engine.kv.block_size == 0
        assert second.choices[0].text == first.choices[0].text
        chat = [{"role": "user", "content": PROMPT}]
        client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, temperature=0)
        again = client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        text = httpx.get(server.base_url + "/metrics", timeout=30).text
        hits, queries = read_metric(text, "deepinfer_prefix_cache_hits_total"), read_metric(
            text, "deepinfer_prefix_cache_queries_total")
        assert hits >= cached + again.usage.prompt_tokens_details.cached_tokens and queries > hits
        assert 0 < read_metric(text, "deepinfer_prefix_cache_hit_rate") < 1
    finally:
        server.stop()
