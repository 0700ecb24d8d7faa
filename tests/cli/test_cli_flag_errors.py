"""CLI errors name the flag the user typed (`--quantization`), never the EngineConfig field behind it.

The engine reports a bad setting as `EngineConfig.<field>`, both when EngineConfig is built (validate)
and later at start-up (the model's limits, the checkpoint's format); the CLI rewrites that to the flag.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deepinfer.entrypoints.cli import main
from deepinfer.entrypoints.cli_args import name_flags

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env")


@pytest.fixture
def ckpt(tiny_cli_ckpt):
    return tiny_cli_ckpt


def _error(capsys, *argv: str) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "deepinfer: error:" in err and "Traceback" not in err
    assert "EngineConfig." not in err, err
    return err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--quantization", "bogus"], ["--quantization"]),
        (["--tensor-parallel-size", "0"], ["--tensor-parallel-size"]),
        (["-tp", "0"], ["-tp"]),  # the spelling the user typed
        (["--max-num-seqs", "0"], ["--max-num-seqs"]),
        (["--max-model-len", "1"], ["--max-model-len"]),
        (["--gpu-memory-utilization", "2"], ["--gpu-memory-utilization"]),
        (["--block-size=0"], ["--block-size"]),
        (["--num-kv-blocks", "4", "--kv-cache-memory-bytes", "1024"], ["--num-kv-blocks", "--kv-cache-memory-bytes"]),
    ],
)
def test_bad_values_name_the_flag(capsys, ckpt, flags, named):
    err = _error(capsys, "generate", ckpt, "hi", "--device", "cpu", *flags)
    for flag in named:
        assert flag in err, err


def test_startup_errors_name_the_flag(capsys, ckpt):
    # above the model's max_position_embeddings: known only once the model is loaded
    err = _error(capsys, "generate", ckpt, "hi", "--device", "cpu", "--max-model-len", "1000000", "--no-progress")
    assert "--max-model-len=1000000" in err and "max_position_embeddings" in err
    # int4 needs an AWQ / GPTQ checkpoint (fp8 on a bf16 checkpoint is online quantization: no error)
    qfile = os.path.join(os.path.dirname(ckpt), "awq-on-bf16.yaml")
    with open(qfile, "w") as f:
        f.write("method: awq\n")
    err = _error(capsys, "generate", ckpt, "hi", "--device", "cpu", "--quantization-config", qfile)
    assert "--quantization-config" in err and "not quantized" in err
    err = _error(capsys, "generate", ckpt, "hi", "--device", "cpu", "--no-chunked-prefill",
                 "--max-num-batched-tokens", "8", "--no-progress")
    assert "--max-num-batched-tokens=8" in err


def test_serve_names_the_flag(ckpt):
    """The same for `deepinfer serve` (its own --max-waiting-requests included), run as a user would."""
    pytest.importorskip("fastapi")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    code = "import sys; from deepinfer.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run(
        [sys.executable, "-c", code, "serve", ckpt, "--device", "cpu", "--port", "0", "--max-waiting-requests", "0"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert "--max-waiting-requests must be" in out.stderr and "EngineConfig." not in out.stderr, out.stderr


def test_name_flags_rules():
    flags = {"max_model_len": ("--max-model-len",), "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
             "async_scheduling": ("--async-scheduling", "--no-async-scheduling")}
    assert name_flags("EngineConfig.max_model_len=5 is too big", flags, []) == "--max-model-len=5 is too big"
    # a field without a flag keeps its name; unrelated text is left alone
    assert name_flags("EngineConfig.load_progress must be a bool", flags, []) == "EngineConfig.load_progress must be a bool"
    assert name_flags("max_model_len and an EngineConfig", flags, []) == "max_model_len and an EngineConfig"
    # the spelling typed last wins; tokens after `--` are not flags
    argv = ["--async-scheduling", "--no-async-scheduling"]
    assert name_flags("EngineConfig.async_scheduling", flags, argv) == "--no-async-scheduling"
    assert name_flags("EngineConfig.tensor_parallel_size", flags, ["-tp=2"]) == "-tp"
    assert name_flags("EngineConfig.tensor_parallel_size", flags, ["--", "-tp"]) == "--tensor-parallel-size"
