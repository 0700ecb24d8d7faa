"""The `deepinfer` console script, driven as a user would: subprocesses, exit codes, stdout/stderr.

User mistakes must exit with code 2 and one `deepinfer: error: ...` message, never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "deepinfer"


def deepinfer(*args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run the installed console script (or the module, where the script is not on this interpreter)."""
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "deepinfer.entrypoints.cli"]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    full_env.update(env or {})
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=full_env, input=stdin, timeout=300)


def deepinfer_at_once(*runs: tuple[tuple[str, ...], dict | None]) -> list[subprocess.CompletedProcess]:
    """`deepinfer(*args, env=env)` for every (args, env), all started at once (each mostly imports, then stops at
    a check); their results in order."""
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "deepinfer.entrypoints.cli"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    procs = [(args, subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**base, **(env or {})})) for args, env in runs]
    try:
        outs = [(args, p, p.communicate(timeout=300)) for args, p in procs]
        return [subprocess.CompletedProcess([*cmd, *args], p.returncode, out, err) for args, p, (out, err) in outs]
    finally:
        for _, p in procs:
            p.kill()


def start_serve(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str, str]:
    """`deepinfer serve ARGS` as a subprocess, read up to its "serving on URL" line: (process, URL, the banner
    so far). DEEPINFER_* of this process are dropped, `env` added."""
    import re

    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "deepinfer.entrypoints.cli"]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    full_env.update(env or {})
    proc = subprocess.Popen([*cmd, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env)
    seen = []
    for line in proc.stdout:  # start-up banner: what was loaded, where, and the URL
        seen.append(line)
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            return proc, m.group(1), "".join(seen)
    proc.kill()
    raise AssertionError("the server did not start:\n" + "".join(seen))


def assert_user_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    assert "error:" in out.stderr
    for needle in needles:
        assert needle in out.stderr, (needle, out.stderr)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny checkpoint written by `deepinfer make-checkpoint` itself."""
    out_dir = tmp_path_factory.mktemp("cli") / "tiny-v2-lite"
    out = deepinfer("make-checkpoint", "--preset", "tiny-v2-lite", str(out_dir), "--seed", "1")
    assert out.returncode == 0, out.stderr
    return out_dir


def test_console_script_is_installed():
    assert SCRIPT.exists(), f"{SCRIPT} missing: is the package installed (pip install -e .)?"
    out = deepinfer("--version")
    assert out.returncode == 0 and out.stdout.startswith("deepinfer ")


def test_backends_lists_cpu_with_caps_and_coverage():
    out, text = deepinfer_at_once((("backends", "--json"), None), (("backends",), None))
    assert out.returncode == 0, out.stderr
    entries = {e["name"]: e for e in json.loads(out.stdout)}
    cpu = entries["cpu"]
    assert cpu["available"] and cpu["reasons"] == []
    assert "float32" in cpu["caps"]["dtypes"]
    assert cpu["op_coverage"]["rms_norm"] == "native"
    assert cpu["op_coverage"]["mla_attention"].startswith("cpu: decode rows batched")  # backends/cpu/ops_mla.py
    for e in entries.values():  # every unavailable backend says why
        assert e["available"] or e["reasons"]
    assert text.returncode == 0 and "cpu" in text.stdout and "available" in text.stdout


def test_make_checkpoint_list_and_bad_preset(tmp_path):
    out, bad = deepinfer_at_once((("make-checkpoint", "--list"), None),
                                 (("make-checkpoint", "--preset", "nosuch", str(tmp_path / "x")), None))
    assert out.returncode == 0, out.stderr
    names = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    assert {"tiny-v2-lite", "tiny-v3-fp8", "v2-lite"} <= names
    assert_user_error(bad, "nosuch", "tiny-v2-lite")


def test_make_checkpoint_writes_hf_layout(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] in ("deepseek_v2", "deepseek_v3")
    assert list(ckpt.glob("*.safetensors")) and (ckpt / "tokenizer.json").exists()
    # refusing to overwrite a non-empty directory
    assert_user_error(deepinfer("make-checkpoint", "--preset", "tiny-v2-lite", str(ckpt)), "already exists")


def test_generate_matches_the_python_api(ckpt, tmp_path):
    from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

    prompts = ["Hello", "The quick brown fox jumps"]
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(prompts) + "\n\n")
    out = deepinfer(
        "generate", str(ckpt), "--prompt-file", str(prompt_file), "--device", "cpu", "--dtype", "float32",
        "--temperature", "0", "--max-tokens", "5", "--ignore-eos", "--json",
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == prompts

    engine = DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=str(ckpt), device="cpu", dtype="float32"))
    ref = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    for row, r in zip(rows, ref):
        assert row["outputs"][0]["token_ids"] == r.token_ids
        assert row["outputs"][0]["text"] == r.text
        assert row["outputs"][0]["finish_reason"] == "length"


def test_generate_chat_and_plain_text_output(ckpt):
    chat, out = deepinfer_at_once(
        (("generate", str(ckpt), "Say hi", "--chat", "--temperature", "0", "--max-tokens", "3", "--no-progress"), None),
        (("generate", str(ckpt), "a", "--n", "2", "--temperature", "1", "--request-seed", "7", "--max-tokens", "3",
          "--json"), None))
    assert chat.returncode == 0, chat.stderr
    assert "loaded" in chat.stderr and "backend cpu" in chat.stderr
    assert out.returncode == 0, out.stderr
    (row,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert [o["index"] for o in row["outputs"]] == [0, 1]


def test_device_env_var_and_bad_device(ckpt):
    flag, env, npu = deepinfer_at_once((("generate", str(ckpt), "hi", "--device", "nosuch"), None),
                                       (("generate", str(ckpt), "hi"), {"DEEPINFER_DEVICE": "nosuch"}),
                                       (("generate", str(ckpt), "hi", "--device", "npu"), None))
    assert_user_error(flag, "nosuch", "cpu")
    assert_user_error(env, "nosuch")
    # a device type no registered backend serves here (no Ascend backend exists yet)
    assert_user_error(npu, "no available backend for device 'npu'", "cpu")


def test_user_errors_exit_2_without_traceback(ckpt, tmp_path):
    missing = tmp_path / "no-such-model"
    # (seven separate runs, started at once: each mostly imports)
    runs = [  # (args, env, what stderr names)
        (("generate", str(missing), "hi", "--device", "cpu"), None, str(missing)),
        (("generate", str(ckpt), "--device", "cpu"), None, "no prompt"),
        (("generate", str(ckpt), "hi", "--temperature", "-1"), None, "temperature"),
        (("generate", str(ckpt), "hi", "--prompt-file", str(tmp_path / "none.txt")), None, "none.txt"),
        # a setting the backend cannot honour, and a malformed environment variable
        # (3 does not divide the attention heads: refused before any rank is spawned)
        (("generate", str(ckpt), "hi", "--tensor-parallel-size", "3"), None, "tensor_parallel_size"),
        (("generate", str(ckpt), "hi"), {"DEEPINFER_BATCH_INVARIANT": "maybe"}, "DEEPINFER_BATCH_INVARIANT"),
        (("generate", str(ckpt), "hi", "--dtype", "float64"), None, None),  # argparse choice error
    ]
    outs = deepinfer_at_once(*((args, env) for args, env, _ in runs))
    for (_, _, needle), out in zip(runs[:-1], outs[:-1]):
        assert_user_error(out, needle)
    out = outs[-1]
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_check_cpu_passes():
    out = deepinfer("check", "--device", "cpu", "--dtype", "float32", "--no-models", "--json")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["ok"] and report["backend"] == "cpu" and report["counts"]["pass"] > 0
    assert report["counts"]["fail"] == report["counts"]["error"] == 0
    assert_user_error(deepinfer("check", "--device", "nosuch"), "nosuch")


def test_serve_flags():
    out = deepinfer("serve", "--help")
    assert out.returncode == 0
    for flag in ("--host", "--port", "--served-model-name", "--api-key", "--max-model-len", "--max-num-seqs",
                 "--tensor-parallel-size", "--gpu-memory-utilization", "--enforce-eager", "--quantization", "--device"):
        assert flag in out.stdout, flag


def test_serve_starts_answers_and_drains_on_sigterm(ckpt):
    """`deepinfer serve` wiring: flags reach the server, it prints its URL, answers, exits 0 on SIGTERM."""
    import re
    import signal
    import urllib.request

    proc, url, banner = start_serve(str(ckpt), "--device", "cpu", "--port", "0", "--served-model-name", "tiny",
                                    "--max-model-len", "256", "--log-level", "warning",
                                    env={"DEEPINFER_API_KEY": "sekret"})  # the documented env default of --api-key
    try:
        assert "backend: cpu" in banner and "max_model_len: 256" in banner and "API key: required" in banner
        assert re.search(r"KV cache: \d+ tokens", banner), banner

        req = urllib.request.Request(url + "/v1/models", headers={"Authorization": "Bearer sekret"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            models = json.loads(resp.read())
        assert [m["id"] for m in models["data"]] == ["tiny"]
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=30)
            raise AssertionError("no API key must be refused")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest


def test_serve_bad_model_dir_is_a_user_error(tmp_path):
    assert_user_error(deepinfer("serve", str(tmp_path / "missing"), "--device", "cpu", "--port", "0"), "missing")
