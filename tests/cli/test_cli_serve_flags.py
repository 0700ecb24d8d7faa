"""`deepinfer serve` and the server's own `python -m deepinfer.entrypoints.openai.server` take the same flags.

The CLI defines the serve flags without importing FastAPI (so `deepinfer --help` works
without the serve extra); this keeps the two definitions from drifting apart.
"""

from __future__ import annotations

import argparse

import pytest

from deepinfer.entrypoints.cli import build_parser


def _options(parser: argparse.ArgumentParser) -> dict[str, object]:
    return {a.dest: a.default for a in parser._actions if a.option_strings and a.dest != "help"}


def _serve_subparser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_serve_flags_match_the_server_module(monkeypatch):
    pytest.importorskip("fastapi")
    monkeypatch.delenv("DEEPINFER_API_KEY", raising=False)
    from deepinfer.entrypoints.openai.server import add_serve_arguments

    ours = _options(_serve_subparser())
    theirs = _options(add_serve_arguments(argparse.ArgumentParser()))
    assert set(ours) == set(theirs)
    differing = {k for k in ours if ours[k] != theirs[k]}
    # the CLI leaves --max-body-bytes unset so run_server applies its own default
    assert differing <= {"max_body_bytes"}, {k: (ours[k], theirs[k]) for k in differing}


def test_serve_parses_into_the_engine_config(tmp_path):
    from deepinfer.entrypoints.cli_args import engine_config_from_args

    args = build_parser().parse_args(
        ["serve", str(tmp_path), "--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "8",
         "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--dtype", "float32"]
    )
    cfg = engine_config_from_args(args)
    assert (cfg.model_name_or_path, cfg.device, cfg.max_model_len, cfg.max_num_seqs) == (str(tmp_path), "cpu", 512, 8)
    assert cfg.gpu_memory_utilization == 0.5 and cfg.enforce_eager is True and cfg.dtype == "float32"
    assert args.host == "127.0.0.1" and args.port == 8000


def test_serve_without_the_serve_extra_says_what_to_install(tmp_path):
    """On a machine without FastAPI (e.g. the GPU image), `deepinfer serve` names the extra to install."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['fastapi'] = None\n"  # makes `import fastapi` raise ImportError
        "from deepinfer.entrypoints.cli import main\n"
        f"sys.exit(main(['serve', {str(tmp_path)!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "pip install 'deepinfer[serve]'" in out.stderr and "fastapi" in out.stderr
