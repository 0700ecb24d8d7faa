"""`deepinfer serve MODEL_PATH [--host] [--port] ...`: flags only.

The OpenAI-compatible server itself lives in deepinfer.entrypoints.openai
(imported only here, lazily, so the CLI works without the `serve` extra);
it builds its EngineConfig with cli_args.engine_config_from_args(args).
"""

from __future__ import annotations

import argparse

from deepinfer.entrypoints.cli_args import add_engine_args

SERVE_DEPENDENCIES = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "starlette")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models).",
    )
    add_serve_arguments(p)
    p.set_defaults(run=run)


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `serve` flags: the engine's (cli_args) plus the server's own. The one definition, FastAPI-free,
    shared by `deepinfer serve` and `python -m deepinfer.entrypoints.openai.server`."""
    add_engine_args(parser)
    h = parser.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    h.add_argument("--port", type=int, default=8000, help="port (0: any free port; the URL is printed)")
    h.add_argument("--served-model-name", default=None, help="model name clients use (default: the model path)")
    h.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1"],
                   help="split <think>...</think> into reasoning_content (chat); constraints apply after it")
    h.add_argument("--json-whitespace", default="flexible", choices=["flexible", "compact"],
                   help="whitespace a JSON constraint allows when the request does not say (compact: none extra)")
    h.add_argument("--api-key", default=None, help="require this bearer token (default: $DEEPINFER_API_KEY; none = no auth)")
    h.add_argument(
        "--max-waiting-requests", type=int, default=None, help="queue length beyond which requests get 503"
    )
    h.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 8 MiB)")
    h.add_argument("--drain-timeout", type=float, default=None, help="seconds SIGTERM waits for in-flight requests")
    h.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    h.add_argument(
        "--no-access-log", action="store_true",
        help="no access-log line per request (method, path, status, tokens, TTFT, time; info level)",
    )
    k = parser.add_argument_group("connections (docs/serving.md says what a client sees at each limit)")
    k.add_argument("--header-timeout", type=float, default=None,
                   help="seconds a client has to send its request line and headers; then 408 and the connection "
                        "closes (default 10; 0: no limit)")
    k.add_argument("--body-timeout", type=float, default=None,
                   help="seconds a client has to send the whole request body once its headers are in; then 408 "
                        "(default 30; 0: no limit)")
    k.add_argument("--keep-alive-timeout", type=float, default=None,
                   help="seconds an idle kept-alive connection stays open (default 5)")
    k.add_argument("--max-header-count", type=int, default=None,
                   help="request headers per request; more: 431 (default 100)")
    k.add_argument("--max-header-bytes", type=int, default=None,
                   help="bytes of request headers (names and values); more: 431 (default 16384)")
    k.add_argument("--max-connections", type=int, default=None,
                   help="open connections; requests on one beyond it get 503 + Retry-After, /health excepted "
                        "(default 1024; 0: no limit)")
    c = parser.add_argument_group("per-request work caps (over a cap: 400 naming the field)")
    c.add_argument("--max-choices-per-request", type=int, default=128,
                   help="prompts x n in one request (default 128)")
    c.add_argument("--max-stop-strings", type=int, default=16, help="stop strings in one request (default 16)")
    c.add_argument("--max-stop-chars", type=int, default=1024,
                   help="total characters of a request's stop strings (default 1024)")
    c.add_argument("--max-logprobs", type=int, default=20,
                   help="completions logprobs / chat top_logprobs, at most 20 (default 20)")
    c.add_argument("--max-output-tokens", type=int, default=None,
                   help="max_tokens / max_completion_tokens (default: max_model_len); also the default "
                        "when a request leaves max_tokens unset")
    return parser


def run(args: argparse.Namespace) -> int:
    from deepinfer.errors import ConfigError

    try:
        from deepinfer.entrypoints.openai.server import run_server
    except ImportError as exc:
        if exc.name and exc.name.split(".")[0] in SERVE_DEPENDENCIES:
            raise ConfigError(
                f"deepinfer serve needs the 'serve' extra ({exc.name} is missing): pip install 'deepinfer[serve]'"
            ) from exc
        raise
    return int(run_server(args) or 0)
