"""Bounded loopback soak of the OpenAI server: many concurrent streams, random disconnects, malformed requests.

    python benchmarks/soak_server.py                      # own server on a tiny checkpoint, 32 streams, 60 s
    python benchmarks/soak_server.py --duration 20 --concurrency 16
    python benchmarks/soak_server.py --model /path/ckpt --device cuda
    python benchmarks/soak_server.py --url http://127.0.0.1:8000 --api-key KEY   # a server already running

Passes (exit 0) when the server answered no 5xx (counted by its own /metrics), every
malformed request got a 4xx, every stream that was not cut on purpose ended with a
finish_reason and `data: [DONE]` (and held no NaN / Infinity), and after the load no KV block
is still in use. Without --url it starts `python -m deepinfer.entrypoints.openai.server` on
127.0.0.1 with a random API key (so bad Authorization headers are exercised), stops it with
SIGTERM at the end and requires a clean exit. Only loopback is allowed.

The malformed mix (issue 11): bad JSON and types, out-of-range values, huge top_k, NaN /
Infinity / 1e999 floats, lone UTF-16 surrogates in every string field, bad Authorization
headers (non-ASCII, other schemes, wrong keys), requests over the per-request caps, fields
naming features the server does not implement, a multi-megabyte prompt, an oversize body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from deepinfer import envs

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Tally:
    completed: int = 0
    disconnected: int = 0
    malformed_rejected: int = 0
    kinds_covered: int = 0
    tokens: int = 0
    failures: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)
        else:
            self.failures[-1] = f"... and more ({what})"


def strict_loads(text: str):
    """json.loads that refuses NaN / Infinity (a server must never write them)."""

    def refuse(name):
        raise ValueError(f"non-JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def malformed_requests(model: str, max_model_len: int, api_key: str | None) -> list[tuple[str, bytes, list | None]]:
    """(path, body, headers to send instead of the client's Authorization, or None) the server must
    reject with a 4xx."""
    j = lambda d: json.dumps(d).encode()  # noqa: E731  (ensure_ascii: a lone surrogate is written as \ud800)
    user = [{"role": "user", "content": "hi"}]
    bodies = [(path, body, None) for path, body in _malformed_bodies(model, max_model_len, j, user)]
    if api_key:
        ok_body = j({"model": model, "prompt": "hi", "max_tokens": 2})
        for value in (b"Bearer \xc3\xa9t\xc3\xa9", b"Bearer " + api_key.encode() + b"\xff", b"\xff\xfe",
                      b"Basic " + api_key.encode(), api_key.encode(), b"Bearer wrong-key", b"Bearer"):
            bodies.append(("/v1/completions", ok_body, [(b"authorization", value)]))
    return bodies


def _malformed_bodies(model: str, max_model_len: int, j, user) -> list[tuple[str, bytes]]:
    big_prompt = j({"model": model, "prompt": "a multi megabyte prompt " * 250_000, "max_tokens": 4})  # 6 MB
    return [
        # huge integers and non-finite floats
        ("/v1/completions", j({"model": model, "prompt": "hi", "top_k": 2**63})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "seed": 2**80})),
        ("/v1/completions", b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % model.encode()),
        ("/v1/completions", b'{"model": "%s", "prompt": "hi", "top_p": Infinity}' % model.encode()),
        ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                                 b'"presence_penalty": -1e999}' % model.encode()),
        ("/v1/completions", j({"model": model, "prompt": "hi", "repetition_penalty": 1e308})),
        # lone surrogates
        ("/v1/completions", j({"model": model, "prompt": "bad \ud800 text"})),
        ("/v1/completions", j({"model": model + "\udfff", "prompt": "hi"})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "stop": ["\ud83d"]})),
        ("/v1/chat/completions", j({"model": model, "messages": [{"role": "user", "content": "x\udc00"}]})),
        ("/v1/completions", b'{"model": "x", "prompt": "\xff\xfe invalid utf-8"}'),
        # over the per-request caps
        ("/v1/completions", j({"model": model, "prompt": ["a", "b", "c"], "n": 50})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "stop": [f"s{i}" for i in range(17)]})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "stop": ["x" * 1025]})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "logprobs": 21})),
        ("/v1/chat/completions", j({"model": model, "messages": user, "logprobs": True, "top_logprobs": 21})),
        ("/v1/chat/completions", j({"model": model, "messages": user, "max_completion_tokens": max_model_len})),
        # features the server does not implement: refused, never ignored
        ("/v1/completions", j({"model": model, "prompt": "hi", "guided_json": {"type": "object"}})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "guided_regex": "[a-z]+"})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "prompt_logprobs": 1})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "stream_options": {"include_usage": True}})),
        ("/v1/chat/completions", j({"model": model, "messages": user, "tool_choice": "auto"})),
        ("/v1/chat/completions", j({"model": model, "messages": user, "tools": [{"type": "function"}]})),
        ("/v1/chat/completions", j({"model": model, "messages": user, "response_format": {"type": "json_object"}})),
        ("/v1/chat/completions", j({"model": model, "messages": user, "structured_outputs": {"choice": ["a"]}})),
        # a prompt of several megabytes (refused after tokenizing about max_model_len tokens of it)
        ("/v1/completions", big_prompt),
        ("/v1/completions", b'{"model": "x", "prompt": '),
        ("/v1/completions", b"not json at all"),
        ("/v1/completions", j({"model": model, "prompt": "hi", "temperature": "hot"})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "top_p": 7})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "n": 0})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "max_tokens": -4})),
        ("/v1/completions", j({"model": model, "prompt": "hi", "max_tokens": max_model_len * 8})),
        ("/v1/completions", j({"model": model, "prompt": [3] * (max_model_len + 5)})),
        ("/v1/completions", j({"model": model, "prompt": [10**9]})),
        ("/v1/completions", j({"model": "no-such-model", "prompt": "hi"})),
        ("/v1/completions", j({"model": model})),
        ("/v1/chat/completions", j({"model": model, "messages": []})),
        ("/v1/chat/completions", j({"model": model, "messages": [{"role": "robot", "content": "hi"}]})),
        ("/v1/chat/completions", j({"model": model, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3})),
        ("/v1/completions", b"{" + b" " * (9 * 1024 * 1024) + b"}"),  # over the default 8 MiB body limit
    ]


async def one_stream(client: httpx.AsyncClient, url: str, model: str, rng: random.Random, args, tally: Tally) -> None:
    chat = rng.random() < 0.5
    max_tokens = rng.randint(4, args.max_tokens)
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": rng.choice([0.0, 0.7, 1.0, 1e-30]),  # 1e-30: greedy, never inf / NaN
        "seed": rng.randint(0, 1000),
        "n": rng.choice([1, 1, 1, 2]),
    }
    with_logprobs = rng.random() < 0.25
    if chat:
        body["messages"] = [{"role": "user", "content": f"soak message {rng.randint(0, 10**6)} " * rng.randint(1, 6)}]
        path = "/v1/chat/completions"
        if with_logprobs:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 5, 20]))
    else:
        body["prompt"] = f"soak prompt {rng.randint(0, 10**6)} " * rng.randint(1, 6)
        path = "/v1/completions"
        if with_logprobs:
            body["logprobs"] = rng.choice([0, 5, 20])
    cut_after = rng.randint(1, 6) if rng.random() < args.disconnect_prob else None
    start = time.monotonic()
    events, finishes, usage, done = 0, 0, None, False
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            tally.fail(f"stream {path} -> {r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                tally.fail(f"non-SSE line {line[:80]!r}")
                return
            if line == "data: [DONE]":
                done = True
                break
            try:
                data = strict_loads(line[6:])
            except ValueError as exc:
                tally.fail(f"invalid JSON in a stream ({exc}): {line[:120]!r}")
                return
            if "error" in data:
                tally.fail(f"in-stream error {data['error']}")
                return
            events += 1
            if events == 1:
                tally.ttft.append(time.monotonic() - start)
            finishes += sum(1 for c in data["choices"] if c.get("finish_reason"))
            usage = data.get("usage") or usage
            if cut_after is not None and events >= cut_after:
                tally.disconnected += 1
                return  # leaving the block closes the connection mid-stream
    if not done or finishes != body["n"] or usage is None:
        tally.fail(f"incomplete stream: done={done} finishes={finishes}/{body['n']} usage={usage}")
        return
    if not 0 < usage["completion_tokens"] <= max_tokens * body["n"]:
        tally.fail(f"usage out of range: {usage} for max_tokens={max_tokens} n={body['n']}")
        return
    tally.completed += 1
    tally.tokens += usage["completion_tokens"]


async def one_malformed(client: httpx.AsyncClient, url: str, item, tally: Tally) -> None:
    path, body, auth = item
    headers = [(b"content-type", b"application/json"), *(auth or [])]
    r = await client.post(url + path, content=body, headers=headers)
    try:
        ok = 400 <= r.status_code < 500 and "error" in strict_loads(r.text)
    except ValueError:
        ok = False
    if ok:
        tally.malformed_rejected += 1
    else:
        tally.fail(f"malformed {body[:60]!r} (auth {auth!r}) -> {r.status_code}: {r.text[:160]!r}")


async def worker(i: int, url: str, model: str, args, deadline: float, tally: Tally, bodies, headers) -> None:
    rng = random.Random(args.seed * 1000 + i)
    sweep = list(bodies[i :: args.concurrency])  # every malformed kind once, spread over the workers
    async with httpx.AsyncClient(timeout=args.request_timeout, headers=headers) as client:
        while time.monotonic() < deadline:
            try:
                if sweep:  # interleaved with this worker's streams, while the others stream
                    await one_malformed(client, url, sweep.pop(0), tally)
                    tally.kinds_covered += 1
                    await one_stream(client, url, model, rng, args, tally)
                elif rng.random() < args.malformed_prob:
                    await one_malformed(client, url, rng.choice(bodies), tally)
                else:
                    await one_stream(client, url, model, rng, args, tally)
            except httpx.HTTPError as exc:
                tally.fail(f"transport error {exc!r}")


def scrape(url: str, headers) -> dict[str, float]:
    """Prometheus samples as {'name{labels}': value}."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def count_5xx(samples: dict[str, float]) -> float:
    return sum(v for k, v in samples.items()
               if k.startswith("deepinfer_http_responses_total") and re.search(r'status="5\d\d"', k))


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    model = args.model
    if model is None:
        from deepinfer.checkpoints import make_checkpoint

        model = os.path.join(tempfile.mkdtemp(prefix="soak-"), "tiny-v2-lite")
        make_checkpoint("tiny-v2-lite", model)
    cmd = [sys.executable, "-m", "deepinfer.entrypoints.openai.server", model, "--host", "127.0.0.1", "--port", "0",
           "--device", args.device, "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    if args.device == "cpu":
        cmd += ["--dtype", "float32"]
    env = dict(os.environ)
    if args.api_key:
        env[envs.API_KEY.name] = args.api_key
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        print("  server:", line.rstrip())
        m = re.search(r"serving on (http://\S+?)\s", line + " ")
        if m:
            return proc, m.group(1), model
    proc.kill()
    raise SystemExit("the server did not start (see its output above)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="soak a running server on loopback instead of starting one")
    p.add_argument("--model", default=None, help="checkpoint for the server started here (default: a tiny one)")
    p.add_argument("--served-model-name", default=None, help="model name to request (default: from /v1/models)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--api-key", default=envs.API_KEY.get())
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--disconnect-prob", type=float, default=0.15)
    p.add_argument("--malformed-prob", type=float, default=0.15)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    proc = None
    if args.url:
        host = urlparse(args.url).hostname
        if host not in LOOPBACK:
            raise SystemExit(f"--url must point at loopback ({', '.join(sorted(LOOPBACK))}), got {host!r}")
        url = args.url.rstrip("/")
    else:
        if not args.api_key:  # its own server: with a key, so bad Authorization headers are part of the mix
            args.api_key = "soak-" + secrets.token_hex(8)
        proc, url, _ = start_server(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
        model = args.served_model_name or models[0]["id"]
        max_model_len = models[0].get("max_model_len") or args.max_model_len
        before = scrape(url, headers)
        tally = Tally()
        bodies = malformed_requests(model, max_model_len, args.api_key)
        t0 = time.monotonic()
        deadline = t0 + args.duration

        async def run_all():
            await asyncio.gather(*(worker(i, url, model, args, deadline, tally, bodies, headers)
                                   for i in range(args.concurrency)))

        asyncio.run(run_all())
        elapsed = time.monotonic() - t0
        # Let aborted requests be released, then read the final accounting.
        settle = time.monotonic() + 30
        after = scrape(url, headers)
        while time.monotonic() < settle and (after.get("deepinfer_kv_blocks_used", 0) or after.get("deepinfer_requests_in_flight", 0)):
            time.sleep(0.2)
            after = scrape(url, headers)
    finally:
        exit_code = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                exit_code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_code = "killed after 60 s"

    server_5xx = count_5xx(after) - count_5xx(before)
    leaked = after.get("deepinfer_kv_blocks_used", float("nan"))
    gen_tokens = after.get("deepinfer_generation_tokens_total", 0) - before.get("deepinfer_generation_tokens_total", 0)
    ttft = sorted(tally.ttft)
    result = {
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "streams_completed": tally.completed,
        "streams_disconnected": tally.disconnected,
        "malformed_rejected_4xx": tally.malformed_rejected,
        "malformed_kinds_sent": f"{tally.kinds_covered}/{len(bodies)}",
        "client_failures": len(tally.failures),
        "server_5xx": int(server_5xx),
        "kv_blocks_leaked": leaked,
        "requests_in_flight_after": after.get("deepinfer_requests_in_flight", float("nan")),
        "completion_tokens_received": tally.tokens,
        "engine_generation_tokens": int(gen_tokens),
        "throughput_tok_s": round(gen_tokens / elapsed, 1),
        "completed_streams_per_s": round(tally.completed / elapsed, 2),
        "ttft_p50_s": round(ttft[len(ttft) // 2], 4) if ttft else None,
        "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))], 4) if ttft else None,
        "server_exit_code": exit_code,
    }
    print("\nsoak result")
    for k, v in result.items():
        print(f"  {k:28s} {v}")
    for f in tally.failures[:10]:
        print("  failure:", f)
    print("SOAK_JSON " + json.dumps(result))
    ok = (server_5xx == 0 and leaked == 0 and not tally.failures and tally.completed > 0
          and tally.kinds_covered == len(bodies) and exit_code in (None, 0))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
