"""The serving benchmark behind `deepinfer bench serve`: HTTP only, against any OpenAI-compatible server.

Every request streams (SSE, `stream_options.include_usage`). Per request it records the time to the
first token (TTFT), the gaps between later chunks (ITL), the end-to-end latency (E2E) and, from the
final usage chunk, the prompt and completion token counts; TPOT is (E2E - TTFT) / (output tokens - 1).
Arrivals are Poisson at `request_rate` (seeded) or all at once; `max_concurrency` caps the requests in
flight (a closed loop when the rate is infinite). No tokenizer is needed client-side: two probe requests
measure how many prompt tokens the server counts per generated word, and the prompts are sized from that;
the reported input lengths are the server's own usage numbers. Needs httpx (the `serve` extra).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
STAT_KEYS = ("mean", "median", "std", "min", "max", "p90", "p99")

# Common English words: one token each in most BPE vocabularies, none of them special.
_WORDS_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more can out up about who "
    "time some into them these may only new could other than then its also first two people any like over "
    "such our most after even made many must did way years where water long little very before great back "
    "through year still own good day under last right state city world house place point small number group "
    "light river stone music story table paper window garden market letter winter summer bridge forest island"
)
WORDS = tuple(_WORDS_TEXT.split())
FIXED_TEXT = (
    "The river runs past the old stone bridge, through the market square and out toward the forest. "
    "In winter the water is slow and the people of the city walk along its banks; in summer the garden "
    "by the bridge is full of light, music and the sound of small boats. "
)


@dataclass
class BenchConfig:
    base_url: str
    model: str
    endpoint: str = COMPLETIONS
    api_key: str | None = None
    dataset: str = "random"  # "random" | "fixed"
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    request_timeout: float = 600.0


@dataclass
class RequestSpec:
    index: int
    text: str
    words: int
    target_input_len: int
    output_len: int


@dataclass
class RequestResult:
    index: int
    target_input_len: int
    target_output_len: int
    success: bool = False
    error: str | None = None
    start_s: float = 0.0  # since the benchmark started
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # the server's usage numbers
    output_tokens: int | None = None
    output_tokens_source: str | None = None  # "usage" | "chunks"

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.ttft_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# ------------------------------------------------------------------ prompts


def endpoint_url(base_url: str, endpoint: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + endpoint


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def make_text(dataset: str, words: int, rng: random.Random) -> str:
    if dataset == "fixed":
        source = FIXED_TEXT.split()
        return " ".join(source[i % len(source)] for i in range(words))
    return " ".join(rng.choices(WORDS, k=words))


def target_lengths(cfg: BenchConfig, rng: random.Random) -> list[tuple[int, int]]:
    """(input, output) token targets per request: uniform in [L*(1-r), L*(1+r)] for random, L for fixed."""

    def draw(length: int) -> int:
        if cfg.range_ratio <= 0:
            return length
        low, high = max(1, math.floor(length * (1 - cfg.range_ratio))), math.ceil(length * (1 + cfg.range_ratio))
        return rng.randint(low, high)

    return [(draw(cfg.input_len), draw(cfg.output_len)) for _ in range(cfg.num_prompts)]


@dataclass
class Calibration:
    """Prompt tokens the server counts for a text of `w` words: overhead + per_word * w."""

    measured: bool
    per_word: float = 1.0
    overhead: float = 0.0
    error: str | None = None

    def words_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.overhead) / self.per_word))

    def as_dict(self) -> dict:
        return {"measured": self.measured, "tokens_per_word": round(self.per_word, 4),
                "overhead_tokens": round(self.overhead, 2), "error": self.error}


def request_body(cfg: BenchConfig, text: str, max_tokens: int, stream: bool) -> dict:
    body: dict = {"model": cfg.model, "temperature": cfg.temperature}
    if cfg.endpoint == CHAT:
        body |= {"messages": [{"role": "user", "content": text}], "max_completion_tokens": max_tokens}
    else:
        body |= {"prompt": text, "max_tokens": max_tokens}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


async def calibrate(client: httpx.AsyncClient, cfg: BenchConfig) -> Calibration:
    """Two non-streaming probes (max_tokens 1) of the dataset's text; their usage fixes tokens per word."""
    rng = random.Random(f"calibration-{cfg.seed}")
    sizes = (32, 160)
    counts = []
    for words in sizes:
        body = request_body(cfg, make_text(cfg.dataset, words, rng), 1, stream=False)
        body.pop("ignore_eos", None)
        try:
            resp = await client.post(endpoint_url(cfg.base_url, cfg.endpoint), json=body,
                                     headers=auth_headers(cfg.api_key))
            if resp.status_code != 200:
                return Calibration(False, error=f"HTTP {resp.status_code}: {error_message(resp.text)}")
            counts.append(int(resp.json()["usage"]["prompt_tokens"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            return Calibration(False, error=describe(exc))
    per_word = (counts[1] - counts[0]) / (sizes[1] - sizes[0])
    if per_word <= 0:
        return Calibration(False, error=f"prompt tokens did not grow with the prompt: {counts}")
    return Calibration(True, per_word, counts[0] - per_word * sizes[0])


def make_specs(cfg: BenchConfig, calibration: Calibration) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    specs = []
    for i, (inp, out) in enumerate(target_lengths(cfg, rng)):
        words = calibration.words_for(inp)
        specs.append(RequestSpec(i, make_text(cfg.dataset, words, rng), words, inp, out))
    return specs


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    return list(itertools.accumulate([0.0] + [rng.expovariate(rate) for _ in range(n - 1)]))


# ------------------------------------------------------------------ one request


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def error_message(text: str) -> str:
    """The message of an OpenAI error body, else the body's start."""
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
    except (ValueError, AttributeError):
        pass
    return text.strip()[:300] or "(empty body)"


def has_token(chunk: dict) -> bool:
    """A chunk carries generated output: text or content (or reasoning), or a finish reason. A chat
    stream's role-only first chunk and the final usage-only chunk do not count."""
    for choice in chunk.get("choices") or ():
        if choice.get("finish_reason") is not None or choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            return True
    return False


async def send_one(client: httpx.AsyncClient, cfg: BenchConfig, spec: RequestSpec, t0: float) -> RequestResult:
    res = RequestResult(spec.index, spec.target_input_len, spec.output_len)
    body = request_body(cfg, spec.text, spec.output_len, stream=True)
    url, headers = endpoint_url(cfg.base_url, cfg.endpoint), auth_headers(cfg.api_key)
    start = time.perf_counter()
    res.start_s = start - t0
    chunks, last, usage, done = 0, start, None, False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")
                res.error = f"HTTP {resp.status_code}: {error_message(text)}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    res.e2e_s, done = time.perf_counter() - start, True
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("error"):
                    err = chunk["error"]
                    res.error = "stream error: " + str(err.get("message") if isinstance(err, dict) else err)[:300]
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if has_token(chunk):
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last, chunks = now, chunks + 1
    except (httpx.HTTPError, ValueError, OSError) as exc:  # connection, timeout, protocol, bad JSON
        res.error = describe(exc)
        return res
    if not done:
        res.error = "the stream ended without data: [DONE]"
    elif res.ttft_s is None:
        res.error = "the stream carried no output"
    else:
        res.success = True
        res.prompt_tokens = _int(usage, "prompt_tokens")
        res.output_tokens = _int(usage, "completion_tokens")
        res.output_tokens_source = "usage"
        if res.output_tokens is None:
            res.output_tokens, res.output_tokens_source = chunks, "chunks"
    return res


def _int(usage: dict | None, key: str) -> int | None:
    value = (usage or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# ------------------------------------------------------------------ the run


async def _run(cfg: BenchConfig) -> tuple[list[RequestResult], float, Calibration, int]:
    limit = cfg.max_concurrency
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit or 100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout), limits=limits) as client:
        calibration = await calibrate(client, cfg)
        specs = make_specs(cfg, calibration)
        offsets = arrival_offsets(len(specs), cfg.request_rate, cfg.seed)
        gate = asyncio.Semaphore(limit or len(specs))  # without a limit it never blocks
        in_flight = peak = 0

        async def one(spec: RequestSpec) -> RequestResult:
            nonlocal in_flight, peak
            async with gate:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await send_one(client, cfg, spec, t0)
                finally:
                    in_flight -= 1

        t0 = time.perf_counter()
        tasks = []
        for spec, offset in zip(specs, offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return list(results), duration, calibration, peak


def run_benchmark(cfg: BenchConfig) -> dict:
    """Run the benchmark; the result as a JSON-ready dict (no NaN / infinity: missing values are None)."""
    results, duration, calibration, peak = asyncio.run(_run(cfg))
    return summarize(cfg, results, duration, calibration, peak)


# ------------------------------------------------------------------ statistics


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def stats_ms(values_s: list[float]) -> dict:
    if not values_s:
        return {k: None for k in STAT_KEYS} | {"count": 0}
    v = sorted(x * 1000.0 for x in values_s)
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / len(v))
    out = {"mean": mean, "median": percentile(v, 50), "std": std, "min": v[0], "max": v[-1],
           "p90": percentile(v, 90), "p99": percentile(v, 99)}
    return {k: round(x, 3) for k, x in out.items()} | {"count": len(v)}


def summarize(cfg: BenchConfig, results: list[RequestResult], duration: float, calibration: Calibration,
              peak: int) -> dict:
    ok = [r for r in results if r.success]
    in_tokens = [r.prompt_tokens if r.prompt_tokens is not None else r.target_input_len for r in ok]
    sources = {"usage" if r.prompt_tokens is not None else "estimate" for r in ok}
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    errors = dict(Counter(r.error or "unknown" for r in results if not r.success))
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("api_key", "request_timeout")}
    config["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate  # JSON has no infinity

    def rate(x: float) -> float | None:
        return round(x / duration, 3) if duration > 0 else None

    from deepinfer import __version__

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "deepinfer_version": __version__,
        "config": config,
        "calibration": calibration.as_dict(),
        "num_prompts": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": round(duration, 4),
        "total_input_tokens": sum(in_tokens), "total_output_tokens": out_tokens,
        "input_tokens_source": "/".join(sorted(sources)) or None,
        "request_throughput": rate(len(ok)), "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(sum(in_tokens) + out_tokens),
        "max_concurrency_observed": peak,
        "ttft_ms": stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itl_s]),
        "e2el_ms": stats_ms([r.e2e_s for r in ok]),
        "errors": errors,
        "requests": [_request_row(r) for r in results],
    }


def _request_row(r: RequestResult) -> dict:
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000.0, 3)

    return {
        "index": r.index, "success": r.success, "error": r.error, "start_s": round(r.start_s, 4),
        "target_input_len": r.target_input_len, "target_output_len": r.target_output_len,
        "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
        "output_tokens_source": r.output_tokens_source,
        "ttft_ms": ms(r.ttft_s), "tpot_ms": ms(r.tpot_s), "e2el_ms": ms(r.e2e_s), "itl_ms": [ms(x) for x in r.itl_s],
    }
