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
from script_runner import SCRIPT, run_script, run_scripts


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
    them, a replica with no work steps with the other (dummy forward); tokens equal one process. The OpenAI
    server runs on the leader: concurrent completions through the official client give the same texts."""
    ref = reference("tiny-v2-lite")
    got = run_script("generate", checkpoint("tiny-v2-lite"),
                     {"data_parallel_size": 2, "enable_expert_parallel": True, "serve": True})
    assert got["greedy"] == ref["greedy"]
    assert got["seeded"] == ref["seeded"]
    assert got["alone"] == ref["greedy"][0]
    assert got["served"] == got["greedy_text"][:4]
    # the leader's stats sum both replicas: every request finished somewhere, two KV caches
    from engine_script import PROMPTS

    st = got["stats"]
    assert st["num_requests_finished"] == 2 * len(PROMPTS) + 1 + 4
    assert st["kv_blocks_total"] == 2 * st["local_kv_blocks_total"]


def test_a_killed_rank_and_a_hung_rank_end_the_engine_with_an_error(failure_scenarios):
    """In one engine a spawned rank is SIGKILLed mid-run, in another SIGSTOPped (run at once with the review's
    failure scenarios: tests/parallel/conftest.py). The first fails at once naming the rank and its exit code;
    the second times out after dist_timeout_s. Every spawned rank is stopped and every later call raises."""
    killed, hung = failure_scenarios["kill"], failure_scenarios["hang"]
    assert killed["error"] is not None and "rank 1 (exit code -9) stopped" in killed["error"], killed
    assert killed["error_after_s"] < 15.0
    assert hung["error"] is not None and "the parallel engine stopped" in hung["error"], hung
    assert "timed out" in hung["error"].lower(), hung
    assert hung["error_after_s"] < 4.0 * 3 + 5.0
    for got in (killed, hung):
        assert got["children_alive"] == [False]
        assert got["later_call"].startswith("DeepInferError: the parallel engine stopped")


def test_tp2_dp2_experts_over_four_ranks_with_eplb_and_v4_tp2_ep2(checkpoint, reference):
    """At once: (a) V3 (group-limited noaux_tc routing) at TP=2 x DP=2 with experts over 4 ranks, EPLB with 4
    redundant slots re-placing experts every 2 steps; (b) V4 at TP=2 with its experts over both ranks. Greedy
    and seeded tokens equal one process; experts moved under EPLB."""
    v3, v4 = run_scripts(
        ("generate", checkpoint("tiny-v3"), {"tensor_parallel_size": 2, "data_parallel_size": 2,
                                             "enable_expert_parallel": True, "enable_eplb": True,
                                             "eplb_num_redundant_experts": 4, "eplb_step_interval": 2}),
        ("generate", checkpoint("tiny-v4"), {"tensor_parallel_size": 2, "enable_expert_parallel": True}))
    for got, preset in ((v3, "tiny-v3"), (v4, "tiny-v4")):
        ref = reference(preset)
        assert got["greedy"] == ref["greedy"], preset
        assert got["seeded"] == ref["seeded"], preset
    assert v3["rebalances"] >= 3 and v3["experts_moved"] > 0, v3


# the layouts joined through the env rendezvous: (torchrun-style or two "nodes", settings)
RENDEZVOUS_LAYOUTS = [
    ("torchrun", {"data_parallel_size": 2, "enable_expert_parallel": True}),
    ("torchrun", {"context_parallel_size": 2, "cp_min_prefill_tokens": 16}),  # the first prefill step is split
    ("nodes", {"data_parallel_size": 2, "enable_expert_parallel": True, "ep_dispatch": "all_to_all"}),
    ("nodes", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
]


def test_torchrun_env_rendezvous_and_two_nodes_on_loopback(checkpoint, reference):
    """Jobs joined two other ways, at once (RENDEZVOUS_LAYOUTS: DP2 + EP, context-parallel prefill, DP2 + EP with
    the all-to-all dispatch, TP2 + EP): (a) torchrun-style, every rank a process started with RANK / WORLD_SIZE /
    MASTER_ADDR / MASTER_PORT (rank 1's engine serves as a follower and exits 0); (b) two "nodes" on loopback:
    node 0's engine is rank 0, node 1's launcher (--node-rank 1) spawns rank 1. Greedy and seeded tokens equal one
    process in every layout."""
    from deepinfer.parallel.local_ranks import free_port

    path, ref = checkpoint("tiny-v2-lite"), reference("tiny-v2-lite")
    procs = []
    for how, layout in RENDEZVOUS_LAYOUTS:
        port = free_port()
        for r in (0, 1):
            if how == "torchrun":
                env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                args = json.dumps(layout)
            else:
                env, args = None, json.dumps(dict(layout, nnodes=2, node_rank=r, master_port=port))
            procs.append(subprocess.Popen([sys.executable, SCRIPT, "generate", path, args], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    for i, (code, out, err) in enumerate(outs):
        assert code == 0, f"process {i} ({RENDEZVOUS_LAYOUTS[i // 2]}) exited {code}:\n{err[-4000:]}"
    for k, (how, layout) in enumerate(RENDEZVOUS_LAYOUTS):
        lines = [ln for ln in outs[2 * k][1].splitlines() if ln.startswith("RESULT ")]  # the leader
        assert lines, outs[2 * k][2][-3000:]
        got = json.loads(lines[-1][len("RESULT "):])
        assert got["greedy"] == ref["greedy"] and got["seeded"] == ref["seeded"], (how, layout)
        if "context_parallel_size" in layout:
            assert got["cp_split_steps"] >= 1, got
        assert not any(ln.startswith("RESULT ") for ln in outs[2 * k + 1][1].splitlines())  # followers print none
