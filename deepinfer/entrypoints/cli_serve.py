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
    h.add_argument("--api-key", default=None, help="require this bearer token (default: $DEEPINFER_API_KEY; none = no auth)")
    h.add_argument(
        "--max-waiting-requests", type=int, default=None, help="queue length beyond which requests get 503"
    )
    h.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 8 MiB)")
    h.add_argument("--drain-timeout", type=float, default=None, help="seconds SIGTERM waits for in-flight requests")
    h.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
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
