"""Expert parallelism's all-to-all dispatch (models/layers/ep_all_to_all.py) over gloo ranks, with the path forced.

Model level (tiny V2-Lite, V3 and V4 presets, fp32, each replica drives its own prompt: prefill, then teacher-forced
decode steps of the single-process greedy tokens): the logits equal the single-process model's (<= 2e-5) and the
all-gather path's (<= 2e-5: the two sum in different orders, ep_all_to_all.py says why) at EP=2 over two
data-parallel replicas and at EP=4 over TP=2 x DP=2 (each tp rank dispatches its share of the replica's tokens);
with EPLB's redundant replicas the loads count every routed (token, slot) pair exactly once, and the logits hold
before and after a re-balance moves experts.

Layer level (V2-Lite's first MoE layer, 2 ranks): uneven routing where no token goes to rank 1's experts (rank 1
receives zero rows, and still answers the collectives); a replica with zero tokens; a replica in its dummy forward
(IdleReplicaForward) sends nothing and counts nothing, on both paths, while the other replica's rows are exact and
every expert's load equals the single-process routing's.

The flag's validation (no processes): EngineConfig.ep_dispatch / ep_all_to_all_min_tokens, the CLI flags.
One 2-rank and one 4-rank run do every multi-process check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer.models.registry import load_model
from deepinfer.parallel.local_ranks import run_local_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "v4"))
from paged_batch_util import PagedKV  # noqa: E402
from v4_helpers import PagedRunner  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 12, 600, 33, 2], [8, 300, 2, 45, 77, 19, 1000]]
DECODE_STEPS = 2
ATOL, RTOL = 2e-5, 1e-5
PRESETS = {"v2": "tiny-v2-lite", "v3": "tiny-v3", "v4": "tiny-v4"}


def _drive(model, kind: str, prompts: list[list[int]], forced: list[list[int]] | None) -> dict:
    """Last-row fp32 logits of a prefill and DECODE_STEPS decodes (tokens: `forced`, else the greedy ones)."""
    if kind == "v4":
        runner = PagedRunner(model)
        for rid in range(len(prompts)):
            runner.add(rid)
    else:
        kv = PagedKV(model)
    chunks = list(enumerate(prompts))
    logits, argmax = [], []
    with torch.no_grad():
        for step in range(DECODE_STEPS + 1):
            ends = torch.tensor([len(t) for _, t in chunks]).cumsum(0) - 1
            if kind == "v4":
                lg = runner.step(chunks)[ends]
            else:
                batch = kv.batch(chunks)
                lg = model.compute_logits(model.forward(batch, kv.caches)[ends])
            logits.append(lg)
            argmax.append(lg.argmax(-1).tolist())
            toks = argmax[-1] if forced is None else forced[step]
            chunks = [(i, [t]) for i, t in enumerate(toks)]
    return {"logits": logits, "argmax": argmax}


def _moe(model, kind: str):
    return model.layers[1].ffn if kind == "v4" else model.layers[1].mlp


def _uneven_inputs(moe, rank1_experts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [5, D] > 0, a gate whose rows for rank 1's experts are zero and the others' > 0): every token's
    logits are positive for rank 0's experts and 0 for rank 1's, so no pair is routed to rank 1."""
    g = torch.Generator().manual_seed(11)
    x = torch.rand(5, moe.hidden_size, generator=g) + 0.1
    gate = torch.rand(moe.num_experts, moe.hidden_size, generator=g) + 0.1
    gate[list(rank1_experts)] = 0.0
    return x, gate


# ---------------------------------------------------------------- one rank's work


def _layer_checks(rank: int, moe) -> dict:
    """2 ranks, 2 replicas (tp 1), the all-to-all path forced: uneven routing, an empty and an idle replica."""
    from deepinfer.models.layers.ep_all_to_all import EPDispatch, IdleReplicaForward

    out: dict = {}
    x, gate = _uneven_inputs(moe, moe.placement.rank_experts(1))
    saved = moe.gate_weight
    moe.gate_weight = gate
    moe.expert_load = torch.zeros(moe.num_experts, dtype=torch.long)
    with torch.no_grad():
        out["uneven"] = moe(x if rank == 0 else x[:3])  # replica 1 routes 3 of the same rows
    out["uneven_load"] = moe.expert_load.clone()
    moe.gate_weight = saved
    xr = torch.randn(4, moe.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y = moe(xr if rank == 0 else xr[:0])  # replica 1 has no tokens
    out["empty"] = (tuple(y.shape), y if rank == 0 else None)
    for mode in ("all_to_all", "all_gather"):
        moe.ep_dispatch = EPDispatch(mode)
        moe.expert_load = torch.zeros(moe.num_experts, dtype=torch.long)
        with torch.no_grad():
            if rank == 0:
                y = moe(xr)
            else:
                with IdleReplicaForward(moe):  # the dummy forward's one token: nothing sent, nothing counted
                    y = moe(xr[:1])
        out[f"idle_{mode}"] = (y, moe.expert_load.clone(), moe.idle_replica)
    moe.ep_dispatch = EPDispatch("all_to_all")
    moe.expert_load = None
    return out


def _rank(rank: int, world: int, paths: dict, refs: dict, cases: list) -> dict:
    from rank_setup import rank_backend

    from deepinfer.models.layers.ep_all_to_all import EPDispatch, set_ep_dispatch
    from deepinfer.parallel.eplb import ExpertBalancer

    out: dict = {}
    for key, (kind, tp, dp, redundant, layer) in cases:
        backend = rank_backend(tp, dp, True, rank)
        model = load_model(paths[kind], backend, torch.float32, progress=False)
        replica = rank // tp
        prompts, ref = [PROMPTS[replica]], refs[kind][f"p{replica}"]
        run: dict = {"layers": set_ep_dispatch(model, EPDispatch("all_to_all"))}
        run["a2a"] = _drive(model, kind, prompts, ref["argmax"])
        set_ep_dispatch(model, EPDispatch("all_gather"))
        run["ag"] = _drive(model, kind, prompts, ref["argmax"])
        set_ep_dispatch(model, EPDispatch("all_to_all"))
        if layer:
            run["layer"] = _layer_checks(rank, _moe(model, kind))
        if redundant is not None:
            balancer = ExpertBalancer(model, backend, num_redundant=redundant)
            run["slots"] = _moe(model, kind).placement.num_slots
            run["redundant"] = _drive(model, kind, prompts, ref["argmax"])  # counts the loads, too
            run["counted"] = balancer.loads().sum(dim=1).tolist()  # per layer, summed over "ep"
            if rank == 0:  # a skewed load (summed over "ep" with the counted one), so the re-balance moves experts
                for m in balancer.layers:
                    m.expert_load[-1] += 1000  # the last expert: one replica in the first placement
            run["moved"] = balancer.rebalance()
            run["placement"] = _moe(model, kind).placement.slot_experts
            run["after"] = _drive(model, kind, prompts, ref["argmax"])
        out[key] = run
    return out


# ---------------------------------------------------------------- checks in the parent


@pytest.fixture(scope="module")
def paths(checkpoint) -> dict:
    return {kind: checkpoint(preset) for kind, preset in PRESETS.items()}


@pytest.fixture(scope="module")
def refs(paths) -> dict:
    from deepinfer.backends.cpu.backend import CPUBackend

    out: dict = {}
    for kind, path in paths.items():
        model = load_model(path, CPUBackend(), torch.float32, progress=False)
        out[kind] = {f"p{i}": _drive(model, kind, [p], None) for i, p in enumerate(PROMPTS)}
        moe = _moe(model, kind)
        out[kind]["moe_layers"] = sum(1 for m in model.modules() if hasattr(m, "expert_load"))
        out[kind]["top_k"], out[kind]["experts"] = moe.router.top_k, moe.num_experts
        if kind == "v2":  # the layer-level references, on the single-process layer
            x, gate = _uneven_inputs(moe, tuple(range(moe.num_experts // 2, moe.num_experts)))
            xr = torch.randn(4, moe.hidden_size, generator=torch.Generator().manual_seed(7))
            saved = moe.gate_weight
            with torch.no_grad():
                moe.gate_weight = gate
                out[kind]["uneven"] = (moe(x), moe(x[:3]))
                moe.gate_weight = saved
                out[kind]["layer"] = moe(xr)
                ids = moe.op.route(moe.op.router_logits(xr, moe.gate_weight), moe.e_score_correction_bias)[1]
            out[kind]["layer_load"] = torch.bincount(ids.reshape(-1), minlength=moe.num_experts)
    return out


def _same(run: dict, ref: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(run["logits"], ref["logits"], strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, s=step: f"{what} step {s}: {m}")
    assert run["argmax"] == ref["argmax"], f"{what}: greedy tokens differ"


def _check_layer(res: list[dict], ref: dict) -> None:
    r0, r1 = res[0], res[1]
    torch.testing.assert_close(r0["uneven"], ref["uneven"][0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(r1["uneven"], ref["uneven"][1], atol=ATOL, rtol=RTOL)
    half = r0["uneven_load"].numel() // 2
    assert int(r0["uneven_load"][half:].sum()) == 0 and int(r1["uneven_load"][half:].sum()) == 0, \
        "a pair was routed to rank 1's experts: the uneven case does not test a rank receiving nothing"
    assert int((r0["uneven_load"] + r1["uneven_load"]).sum()) == (5 + 3) * 2  # every pair, once
    torch.testing.assert_close(r0["empty"][1], ref["layer"], atol=ATOL, rtol=RTOL)
    assert r1["empty"][0] == (0, ref["layer"].shape[1])
    for mode in ("all_to_all", "all_gather"):
        (y0, load0, _), (y1, load1, idle_after) = r0[f"idle_{mode}"], r1[f"idle_{mode}"]
        torch.testing.assert_close(y0, ref["layer"], atol=ATOL, rtol=RTOL, msg=lambda m, mode=mode: f"{mode}: {m}")
        assert y1.shape == (1, ref["layer"].shape[1]) and not y1.any(), f"{mode}: the idle replica's output"
        assert not idle_after, "IdleReplicaForward left the layer idle"
        assert torch.equal(load0 + load1, ref["layer_load"]), f"{mode}: EPLB loads with an idle replica"


def _check(results: list[dict], refs: dict, cases: list) -> None:
    for key, (kind, tp, dp, redundant, layer) in cases:
        ref_kind = refs[kind]
        for rank, res in enumerate(results):
            run, ref = res[key], ref_kind[f"p{rank // tp}"]
            assert run["layers"] == ref_kind["moe_layers"], f"{key}: set_ep_dispatch missed a MoE layer"
            _same(run["a2a"], ref, f"{key} rank {rank} all_to_all")
            _same(run["ag"], ref, f"{key} rank {rank} all_gather")
            for a, b in zip(run["a2a"]["logits"], run["ag"]["logits"], strict=True):
                torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
            if redundant is not None:
                assert run["slots"] == ref_kind["experts"] + redundant
                _same(run["redundant"], ref, f"{key} rank {rank} with {redundant} redundant slots")
                # every replica's prefill + decode tokens, top_k pairs each, counted once per MoE layer
                pairs = (sum(len(p) for p in PROMPTS[:dp]) + DECODE_STEPS * dp) * ref_kind["top_k"]
                assert run["counted"] == [pairs] * ref_kind["moe_layers"], f"{key}: loads {run['counted']}"
                assert run["moved"] > 0, f"{key}: the re-balance moved no expert"
                _same(run["after"], ref, f"{key} rank {rank} after the re-balance")
        if redundant is not None:
            assert len({res[key]["placement"] for res in results}) == 1
        if layer:
            _check_layer([res[key]["layer"] for res in results], ref_kind)


# key: (model, tp, dp, EPLB redundant slots or None, layer-level checks); expert parallelism on, all_to_all forced
CASES_2 = [
    ("v2-ep2-dp2", ("v2", 1, 2, 2, True)),
    ("v3-ep2-dp2", ("v3", 1, 2, None, False)),
    ("v4-ep2-dp2", ("v4", 1, 2, 2, False)),
]
CASES_4 = [
    ("v2-ep4-tp2-dp2", ("v2", 2, 2, 4, False)),
    ("v3-ep4-tp2-dp2", ("v3", 2, 2, None, False)),
    ("v4-ep4-tp2-dp2", ("v4", 2, 2, None, False)),
]


def test_two_ranks_all_to_all(paths, refs):
    results = run_local_ranks(_rank, 2, paths, refs, CASES_2, timeout_s=240)
    _check(results, refs, CASES_2)


def test_four_ranks_all_to_all_over_tp_and_dp(paths, refs):
    results = run_local_ranks(_rank, 4, paths, refs, CASES_4, timeout_s=240)
    _check(results, refs, CASES_4)


# the engine in a fresh interpreter (the test process never joins a process group); the leader spawns rank 1
ENGINE_CODE = r"""
import json, sys
from deepinfer import LLM, SamplingParams
prompts = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], device="cpu", load_progress=False, max_model_len=128, dist_timeout_s=20.0,
          data_parallel_size=2, enable_expert_parallel=True, ep_dispatch="all_to_all", enable_eplb=True,
          eplb_num_redundant_experts=2, eplb_step_interval=2)
greedy = SamplingParams(max_tokens=6, temperature=0.0)
seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=1234)
out = {"greedy": [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)],
       "seeded": [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)],
       "alone": llm.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids,
       "paths": [m.dispatch_counts for m in llm.model.modules() if hasattr(m, "dispatch_counts")],
       "rebalances": llm._leader.num_rebalances}
llm.shutdown()
print("RESULT " + json.dumps(out))
"""
ENGINE_PROMPTS = [[1, 2, 3, 4 + i] for i in range(4)] + [[7, 8, 9] * 6]


def test_engine_dp2_all_to_all_with_dummy_forwards_and_eplb(checkpoint):
    """Through the engine: DP=2 with experts over both ranks, ep_dispatch="all_to_all" (EngineConfig wired to every
    MoE layer: the leader's layers ran no all-gather forward), EPLB re-placing 2 redundant slots every 2 steps.
    Greedy and seeded tokens equal one process, also for a request alone, whose other replica runs dummy forwards
    (zero tokens through the all_to_all)."""
    import json
    import subprocess

    from deepinfer import LLM, SamplingParams

    path = checkpoint("tiny-v2-lite")
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_CODE, path, json.dumps(ENGINE_PROMPTS)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    llm = LLM(path, device="cpu", load_progress=False, max_model_len=128)  # the reference, meanwhile
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=1234)
    ref_greedy = [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS, greedy, use_tqdm=False)]
    ref_seeded = [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS, seeded, use_tqdm=False)]
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}:\n{err[-4000:]}"
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["greedy"] == ref_greedy
    assert got["seeded"] == ref_seeded
    assert got["alone"] == ref_greedy[0]
    assert got["rebalances"] >= 3, got
    assert len(got["paths"]) == 2 and all(set(p) == {"all_to_all"} and p["all_to_all"] > 0 for p in got["paths"]), got


# ---------------------------------------------------------------- the flag (no processes)


def test_ep_dispatch_flag_validation_and_threshold():
    import argparse
    import dataclasses
    import types

    from deepinfer import config as config_mod
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.config import EngineConfig
    from deepinfer.engine.parallel_setup import join_parallel_job
    from deepinfer.entrypoints.cli_args import add_engine_args, engine_config_from_args, engine_flags, name_flags
    from deepinfer.errors import ConfigError
    from deepinfer.models.layers import ep_all_to_all as ea

    assert config_mod.EP_DISPATCH_MODES == ea.EP_DISPATCH_MODES
    assert config_mod.DEFAULT_EP_ALL_TO_ALL_MIN_TOKENS == ea.DEFAULT_ALL_TO_ALL_MIN_TOKENS
    ep = {"enable_expert_parallel": True, "data_parallel_size": 2}
    cases = [  # settings -> the words the error must hold
        ({**ep, "ep_dispatch": "alltoall"}, ["EngineConfig.ep_dispatch", "auto, all_to_all, all_gather"]),
        ({**ep, "ep_dispatch": None}, ["EngineConfig.ep_dispatch"]),
        ({"ep_dispatch": "all_to_all"}, ["EngineConfig.ep_dispatch", "enable_expert_parallel"]),
        ({**ep, "ep_all_to_all_min_tokens": 0}, ["EngineConfig.ep_all_to_all_min_tokens", ">= 1"]),
        ({**ep, "ep_all_to_all_min_tokens": True}, ["EngineConfig.ep_all_to_all_min_tokens"]),
        ({"ep_all_to_all_min_tokens": 64}, ["EngineConfig.ep_all_to_all_min_tokens", "enable_expert_parallel"]),
        ({**ep, "ep_dispatch": "all_gather", "ep_all_to_all_min_tokens": 64},
         ["EngineConfig.ep_all_to_all_min_tokens", "ep_dispatch='auto' only"]),
    ]
    for settings, words in cases:
        with pytest.raises(ConfigError) as err:
            EngineConfig(**settings)
        assert all(w in str(err.value) for w in words), (settings, str(err.value))
    assert EngineConfig(**ep, ep_dispatch="all_to_all").ep_dispatch == "all_to_all"
    assert EngineConfig(**ep, ep_all_to_all_min_tokens=64).ep_all_to_all_min_tokens == 64
    # the CLI: flags onto the fields, errors in the flags' names, unknown modes refused by argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["m", "-dp", "2", "--enable-expert-parallel", "--ep-dispatch", "all_gather", "--ep-all-to-all-min-tokens",
            "8"]
    with pytest.raises(ConfigError) as err:
        engine_config_from_args(parser.parse_args(argv))
    msg = name_flags(str(err.value), engine_flags(parser), argv)
    assert "--ep-all-to-all-min-tokens" in msg and "EngineConfig." not in msg, msg
    cfg = engine_config_from_args(parser.parse_args(argv[:-2]))
    assert (cfg.ep_dispatch, cfg.ep_all_to_all_min_tokens) == ("all_gather", 256)
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--ep-dispatch", "bogus"])
    # the layers' own record of it, and auto's threshold
    with pytest.raises(ConfigError, match="ep_dispatch='nope'"):
        ea.EPDispatch("nope")
    with pytest.raises(ConfigError, match="ep_all_to_all_min_tokens=0"):
        ea.EPDispatch("auto", 0)
    auto = ea.EPDispatch("auto", 10)
    assert [auto.use_all_to_all(n) for n in (0, 9, 10, 500)] == [False, False, True, True]
    assert ea.EPDispatch("all_to_all").use_all_to_all(0) and not ea.EPDispatch("all_gather").use_all_to_all(10 ** 6)
    # decode graphs cannot hold the all-to-all's host-side split sizes: refused at start-up, before any process
    graphs = types.SimpleNamespace(caps=dataclasses.replace(CPUBackend().caps, graph_capture=True))
    for settings in ({"ep_dispatch": "all_to_all"}, {"ep_all_to_all_min_tokens": 16, "max_num_seqs": 16}):
        # (+ a host KV tier, refused with several ranks too: the check never goes on to spawn a rank)
        cfg = EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True, kv_host_cache_gib=1.0, **settings)
        with pytest.raises(ConfigError, match="decode graphs with ep_dispatch"):
            join_parallel_job(cfg, graphs, {"n_routed_experts": 8, "num_attention_heads": 4})
