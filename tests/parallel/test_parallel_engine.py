"""The parallel engine end to end on the CPU (gloo): several processes, one engine.

Each case runs tests/parallel/engine_script.py in a fresh interpreter (the test process never joins a
process group), which builds the engine with the layout asked for: it spawns the other ranks itself. The
reference is the one-process engine on the same checkpoint, in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "engine_script.py")


def run_script(mode: str, path: str, settings: dict, timeout: float = 180.0) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, SCRIPT, mode, path, json.dumps(settings)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy and seeded outputs of the one-process engine, keyed by preset."""
    sys.path.insert(0, os.path.dirname(__file__))
    from engine_script import PROMPTS

    from deepinfer import LLM, SamplingParams

    made = {}

    def get(preset: str) -> dict:
        if preset not in made:
            llm = LLM(checkpoint(preset), device="cpu", load_progress=False, max_model_len=128)
            greedy = SamplingParams(max_tokens=6, temperature=0.0)
            seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=1234)
            made[preset] = {
                "greedy": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)],
                "seeded": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded, use_tqdm=False)],
            }
        return made[preset]

    return get


def test_data_parallel_replicas_with_expert_parallelism_equal_one_process(checkpoint, reference):
    """DP=2 with experts over both ranks: requests are routed to both replicas, the MoE collectives span
    them, a replica with no work steps with the other (dummy forward); tokens equal one process."""
    ref = reference("tiny-v2-lite")
    got = run_script("generate", checkpoint("tiny-v2-lite"),
                     {"data_parallel_size": 2, "enable_expert_parallel": True})
    assert got["greedy"] == ref["greedy"]
    assert got["seeded"] == ref["seeded"]
    assert got["alone"] == ref["greedy"][0]


def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(checkpoint):
    got = run_script("kill", checkpoint("tiny-v2-lite"), {"data_parallel_size": 2, "dist_timeout_s": 10.0})
    assert got["error"] is not None and "rank 1 (exit code -9) stopped" in got["error"], got
    assert got["error_after_s"] < 15.0
    assert got["children_alive"] == [False]
    assert got["later_call"].startswith("DeepInferError: the parallel engine stopped")


def test_a_hung_rank_times_out_and_every_rank_stops(checkpoint):
    got = run_script("hang", checkpoint("tiny-v2-lite"), {"data_parallel_size": 2, "dist_timeout_s": 4.0})
    assert got["error"] is not None and "the parallel engine stopped" in got["error"], got
    assert "Timed out" in got["error"] or "timed out" in got["error"].lower(), got
    assert got["error_after_s"] < 4.0 * 3 + 5.0
    assert got["children_alive"] == [False]
