"""The `deepinfer` console script: argparse front end over the public API.

Each subcommand lives in its own module (cli_<name>.py) exposing
`add_parser(subparsers)` and `run(args) -> int`. Here we only dispatch and turn
the errors a user can cause (deepinfer.errors, missing files) into one
`deepinfer: error: ...` message on stderr and exit code 2, without a traceback.
A setting the engine names as `EngineConfig.<field>` is reported as the flag the user typed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deepinfer.entrypoints import cli_backends, cli_bench, cli_checkpoint, cli_generate, cli_serve
from deepinfer.entrypoints.cli_args import user_message

EXIT_USER_ERROR = 2
_SUBCOMMANDS = (cli_generate, cli_serve, cli_backends, cli_checkpoint, cli_bench)


def build_parser() -> argparse.ArgumentParser:
    from deepinfer import __version__

    parser = argparse.ArgumentParser(
        prog="deepinfer",
        description="DeepInfer: an inference engine for DeepSeek models on NVIDIA GPUs, Ascend NPUs and the CPU.",
    )
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    from deepinfer.errors import DeepInferError

    try:
        return int(args.run(args) or 0)
    except DeepInferError as exc:
        return _user_error(exc, args, argv)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        return _user_error(exc, args, argv)
    except KeyboardInterrupt:
        print("deepinfer: interrupted", file=sys.stderr)
        return 130


def _user_error(exc: BaseException, args: argparse.Namespace | None = None, argv: Sequence[str] = ()) -> int:
    print(f"deepinfer: error: {user_message(exc, args, argv)}", file=sys.stderr)
    return EXIT_USER_ERROR


if __name__ == "__main__":  # python -m deepinfer.entrypoints.cli
    sys.exit(main())
