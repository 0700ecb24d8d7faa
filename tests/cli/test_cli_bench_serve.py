"""`deepinfer bench serve` against a real `deepinfer serve` (a subprocess on loopback, tiny checkpoint).

One server for the module, started with an API key (so auth failures are checked on the same server);
the benchmark runs in-process through the CLI's main(). A handful of short requests each run keeps the
module well under a minute on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from deepinfer.entrypoints import bench_serve
from deepinfer.entrypoints.cli import main

API_KEY = "bench-test-key"
STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


@pytest.fixture(scope="module")
def server_url(tiny_cli_ckpt, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("bench_server") / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    cmd = [sys.executable, "-m", "deepinfer.entrypoints.cli", "serve", tiny_cli_ckpt, "--device", "cpu",
           "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "16", "--port", "0",
           "--api-key", API_KEY, "--log-level", "warning"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = None
    deadline = time.monotonic() + 60
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        for line in log_path.read_text().splitlines():
            if "serving on http://" in line:
                url = line.split("serving on ")[1].split()[0]
        time.sleep(0.1)
    if url is None:
        proc.kill()
        pytest.fail(f"deepinfer serve did not start:\n{log_path.read_text()[-3000:]}")
    yield url
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _bench(tmp_path, capsys, *flags: str) -> tuple[int, dict, str, str]:
    result_file = tmp_path / "result.json"
    rc = main(["bench", "serve", *flags, "--result-file", str(result_file)])
    out, err = capsys.readouterr()
    return rc, json.loads(result_file.read_text()), out, err


def _check_metrics(result: dict) -> None:
    """Every metric is there; counts add up; stats are ordered; each request's TTFT <= its E2E."""
    for key in ("completed", "failed", "num_prompts", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "errors", "requests"):
        assert key in result, key
    assert result["completed"] + result["failed"] == result["num_prompts"] == len(result["requests"])
    assert result["failed"] == sum(result["errors"].values())
    for name in STATS:
        s = result[name]
        assert set(bench_serve.STAT_KEYS) <= set(s), (name, s)
        assert all(s[k] is not None for k in bench_serve.STAT_KEYS), (name, s)
        assert 0 <= s["min"] <= s["median"] <= s["p90"] <= s["p99"] <= s["max"], (name, s)
        assert s["min"] <= s["mean"] <= s["max"], (name, s)
    ok = [r for r in result["requests"] if r["success"]]
    assert result["ttft_ms"]["count"] == result["e2el_ms"]["count"] == len(ok)
    assert result["itl_ms"]["count"] == sum(len(r["itl_ms"]) for r in ok)
    for r in ok:
        assert 0 < r["ttft_ms"] <= r["e2el_ms"], r
        assert r["prompt_tokens"] > 0 and r["output_tokens"] >= 1, r
        assert sum(r["itl_ms"]) <= r["e2el_ms"] - r["ttft_ms"] + 1e-3, r
    assert result["total_output_tokens"] == sum(r["output_tokens"] for r in ok)
    assert result["total_input_tokens"] == sum(r["prompt_tokens"] for r in ok)
    assert result["request_throughput"] == pytest.approx(len(ok) / result["duration_s"], rel=0.01)
    json.dumps(result, allow_nan=False)  # no NaN / infinity anywhere


def test_poisson_rate_on_completions(server_url, tmp_path, capsys):
    rc, result, out, _ = _bench(
        tmp_path, capsys, "--base-url", server_url, "--api-key", API_KEY, "--num-prompts", "6",
        "--request-rate", "20", "--input-len", "48", "--output-len", "8", "--ignore-eos", "--seed", "3",
    )
    assert rc == 0, result["errors"]
    assert result["completed"] == 6 and result["failed"] == 0
    _check_metrics(result)
    # --ignore-eos: every request made exactly --output-len tokens, counted from the server's usage
    assert [r["output_tokens"] for r in result["requests"]] == [8] * 6
    assert {r["output_tokens_source"] for r in result["requests"]} == {"usage"}
    assert result["input_tokens_source"] == "usage" and result["calibration"]["measured"]
    # the prompts were sized from the calibration: near the target (the tiny tokenizer is a rough one)
    assert all(24 <= r["prompt_tokens"] <= 96 for r in result["requests"]), result["requests"]
    starts = [r["start_s"] for r in result["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0  # sent one after another at Poisson times
    assert result["config"]["request_rate"] == 20.0 and result["config"]["model"]  # model from /v1/models
    assert "Serving Benchmark Result" in out and "P99 TTFT (ms)" in out and "Successful requests" in out


def test_concurrency_on_chat_with_ranges(server_url, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DEEPINFER_API_KEY", API_KEY)  # the key comes from the environment here
    rc, result, _, _ = _bench(
        tmp_path, capsys, "--base-url", server_url + "/v1", "--endpoint", "/v1/chat/completions",
        "--model", _served_model(server_url), "--num-prompts", "6",
        "--max-concurrency", "2", "--input-len", "32", "--output-len", "6", "--range-ratio", "0.5",
    )
    assert rc == 0, result["errors"]
    _check_metrics(result)
    assert result["max_concurrency_observed"] == 2 and result["config"]["max_concurrency"] == 2
    targets = [r["target_output_len"] for r in result["requests"]]
    assert all(3 <= t <= 9 for t in targets) and len(set(targets)) > 1, targets
    assert all(r["output_tokens"] <= r["target_output_len"] for r in result["requests"])


def test_fixed_dataset_sends_one_prompt(server_url, tmp_path, capsys):
    rc, result, _, _ = _bench(
        tmp_path, capsys, "--base-url", server_url, "--api-key", API_KEY, "--dataset", "fixed",
        "--num-prompts", "3", "--input-len", "40", "--output-len", "4", "--max-concurrency", "3",
    )
    assert rc == 0, result["errors"]
    _check_metrics(result)
    assert len({r["prompt_tokens"] for r in result["requests"]}) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wrong_url_and_wrong_key_are_counted_failures(server_url, tmp_path, capsys):
    rc, result, out, err = _bench(
        tmp_path, capsys, "--base-url", f"http://127.0.0.1:{_free_port()}", "--model", "m", "--num-prompts", "4",
        "--request-rate", "50",
    )
    assert rc == 1 and "Traceback" not in out + err
    assert result["completed"] == 0 and result["failed"] == 4 == result["num_prompts"]
    assert result["calibration"]["measured"] is False
    assert len(result["errors"]) == 1 and "Connect" in next(iter(result["errors"]))
    for name in STATS:  # every metric is still there, empty
        assert result[name]["count"] == 0 and result[name]["p99"] is None
    assert result["request_throughput"] == 0 and result["total_output_tokens"] == 0
    assert "4 of 4 requests failed" in err

    rc, result, _, _ = _bench(tmp_path, capsys, "--base-url", server_url, "--model", _served_model(server_url),
                              "--api-key", "wrong", "--num-prompts", "2")
    assert rc == 1 and result["failed"] == 2
    assert list(result["errors"]) and next(iter(result["errors"])).startswith("HTTP 401")


def test_usage_errors_exit_2_without_a_traceback(tmp_path, capsys):
    assert main(["bench", "serve", "--base-url", "localhost:8000", "--model", "m"]) == 2
    assert "must start with http://" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{_free_port()}"]) == 2
    assert "pass --model" in capsys.readouterr().err
    assert main(["bench", "serve", "--model", "m", "--result-file", str(tmp_path / "no" / "r.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["bench", "serve", "--model", "m", "--dataset", "fixed", "--range-ratio", "0.2"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--request-rate", "0"])
    assert exc.value.code == 2


def test_without_httpx_it_names_the_extra(tmp_path):
    code = (
        "import sys; sys.modules['httpx'] = None\n"  # makes `import httpx` raise ImportError
        "from deepinfer.entrypoints.cli import main\n"
        "sys.exit(main(['bench', 'serve', '--model', 'm']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stderr
    assert "deepinfer[serve]" in out.stderr and "Traceback" not in out.stderr


def test_arrivals_prompts_and_percentiles_are_seeded_and_exact():
    a = bench_serve.arrival_offsets(2000, 10.0, seed=7)
    assert a == bench_serve.arrival_offsets(2000, 10.0, seed=7) != bench_serve.arrival_offsets(2000, 10.0, seed=8)
    assert a[0] == 0.0 and a == sorted(a)
    assert a[-1] / (len(a) - 1) == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate
    assert bench_serve.arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    cfg = bench_serve.BenchConfig(base_url="http://x", model="m", num_prompts=5, input_len=20, range_ratio=0.5)
    cal = bench_serve.Calibration(True, per_word=2.0, overhead=4.0)
    specs = bench_serve.make_specs(cfg, cal)
    assert [s.text for s in specs] == [s.text for s in bench_serve.make_specs(cfg, cal)]
    assert all(10 <= s.target_input_len <= 30 and s.words == round((s.target_input_len - 4) / 2) for s in specs)
    assert bench_serve.endpoint_url("http://h:1/v1/", "/v1/completions") == "http://h:1/v1/completions"
    values = [0.001 * x for x in (5, 1, 4, 2, 3)]
    s = bench_serve.stats_ms(values)
    assert (s["min"], s["median"], s["max"], s["mean"]) == (1.0, 3.0, 5.0, 3.0)
    assert s["p90"] == pytest.approx(4.6) and s["p99"] == pytest.approx(4.96)  # numpy's linear interpolation
    assert bench_serve.stats_ms([])["p99"] is None


def _served_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]
