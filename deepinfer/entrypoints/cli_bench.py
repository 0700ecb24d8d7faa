"""`deepinfer bench serve`: a serving benchmark against any OpenAI-compatible URL (flags only).

The benchmark itself is bench_serve.py (HTTP only, through httpx, imported lazily here so that
`deepinfer --help` works without it). Exit code 0 when every request succeeded, 1 when any failed
(the result file is written either way), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 ('inf' for no limit)")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 1)")
    return value


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (serve: load an OpenAI-compatible server)",
                                  description="Benchmarks. `deepinfer bench serve --help` for the serving one.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    p = sub.add_parser(
        "serve",
        help="serving benchmark against an OpenAI-compatible URL (ours or another engine's)",
        description="Stream requests to an OpenAI-compatible server at a Poisson request rate or a fixed "
        "concurrency; report TTFT, TPOT, ITL and end-to-end latency (mean / median / p90 / p99), throughput "
        "and failures, and optionally write them as JSON. Exit 0 when every request succeeded, 1 otherwise.",
    )
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default http://127.0.0.1:8000)")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--model", default=None, help="model name to send (default: the first id of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="bearer token (default: $DEEPINFER_API_KEY; none = no header)")
    g.add_argument("--request-timeout", type=_positive_float, default=600.0,
                   help="seconds to wait for a connection or the next chunk (default 600)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=["random", "fixed"], default="random",
                   help="random: random common words per prompt; fixed: the same passage for every prompt")
    w.add_argument("--num-prompts", type=_positive_int, default=100, help="requests to send (default 100)")
    w.add_argument("--input-len", type=_positive_int, default=256, help="prompt tokens per request (default 256)")
    w.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens per request (default 128)")
    w.add_argument("--range-ratio", type=_ratio, default=0.0,
                   help="random dataset: lengths uniform in [L*(1-r), L*(1+r)] (default 0: exact)")
    w.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request makes --output-len")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    w.add_argument("--seed", type=int, default=0, help="seeds the prompts, the lengths and the arrivals")
    t = p.add_argument_group("load")
    t.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="Poisson arrivals at this many requests/s (default inf: all at once)")
    t.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="most requests in flight (with the default rate: a closed loop of this many clients)")
    o = p.add_argument_group("output")
    o.add_argument("--result-file", default=None, help="write the result (summary + per-request rows) as JSON here")
    o.add_argument("--json", action="store_true", help="print the result JSON instead of the table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deepinfer.errors import ConfigError

    try:
        import httpx  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "deepinfer bench serve needs httpx, which is not installed: pip install 'deepinfer[serve]' "
            "(or pip install httpx)"
        ) from exc
    if not args.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"--base-url {args.base_url!r} must start with http:// or https://")
    if args.dataset == "fixed" and args.range_ratio:
        raise ConfigError("--range-ratio applies to --dataset random only (fixed prompts all have one length)")
    if args.result_file:
        parent = os.path.dirname(os.path.abspath(args.result_file))
        if not os.path.isdir(parent):
            raise ConfigError(f"--result-file {args.result_file!r}: the folder {parent} does not exist")
    from deepinfer import envs
    from deepinfer.entrypoints import bench_serve

    api_key = args.api_key if args.api_key is not None else envs.API_KEY.get()
    model = args.model or _first_model(args.base_url, api_key, args.request_timeout)
    cfg = bench_serve.BenchConfig(
        base_url=args.base_url, model=model, endpoint=args.endpoint, api_key=api_key, dataset=args.dataset,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        seed=args.seed, ignore_eos=args.ignore_eos, temperature=args.temperature,
        request_timeout=args.request_timeout,
    )
    result = bench_serve.run_benchmark(cfg)
    text = json.dumps(result, indent=2, allow_nan=False)
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text if args.json else format_report(result))
    if args.result_file and not args.json:
        print(f"result written to {args.result_file}")
    if result["failed"]:
        print(f"deepinfer bench serve: {result['failed']} of {result['num_prompts']} requests failed", file=sys.stderr)
        return 1
    return 0


def _first_model(base_url: str, api_key: str | None, timeout: float) -> str:
    """The first served model id, from GET /v1/models."""
    import httpx

    from deepinfer.entrypoints.bench_serve import auth_headers, describe, endpoint_url, error_message
    from deepinfer.errors import ConfigError

    url = endpoint_url(base_url, "/v1/models")
    try:
        resp = httpx.get(url, headers=auth_headers(api_key), timeout=min(timeout, 30.0))
        if resp.status_code != 200:
            problem = f"HTTP {resp.status_code}: {error_message(resp.text)}"
        else:
            data = resp.json().get("data") or []
            if data and data[0].get("id"):
                return str(data[0]["id"])
            problem = "it lists no model"
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        problem = describe(exc)
    raise ConfigError(f"could not read the model name from {url} ({problem}): pass --model")


SECTIONS = (("ttft_ms", "Time to First Token", "TTFT"), ("tpot_ms", "Time per Output Token (excl. 1st)", "TPOT"),
            ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL"))


def format_report(result: dict) -> str:
    """The result as a table (the layout of `vllm bench serve`, so the two read side by side)."""
    c, width = result["config"], 50

    def row(label: str, value) -> str:
        text = "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
        return f"{label:<40}{text:>10}"

    lines = [" Serving Benchmark Result ".center(width, "="),
             row("Endpoint:", c["endpoint"]), row("Request rate (req/s):", c["request_rate"]),
             row("Max concurrency:", c["max_concurrency"] or "-"),
             row("Successful requests:", result["completed"]), row("Failed requests:", result["failed"]),
             row("Benchmark duration (s):", result["duration_s"]),
             row("Total input tokens:", result["total_input_tokens"]),
             row("Total generated tokens:", result["total_output_tokens"]),
             row("Request throughput (req/s):", result["request_throughput"]),
             row("Output token throughput (tok/s):", result["output_throughput"]),
             row("Total token throughput (tok/s):", result["total_token_throughput"])]
    for key, title, short in SECTIONS:
        s = result[key]
        lines.append(title.center(width, "-"))
        lines += [row(f"{name} {short} (ms):", s[stat]) for name, stat in
                  (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P99", "p99"))]
    lines.append("=" * width)
    for message, count in sorted(result["errors"].items(), key=lambda kv: -kv[1])[:5]:
        lines.append(f"failed x{count}: {message}")
    return "\n".join(lines)
