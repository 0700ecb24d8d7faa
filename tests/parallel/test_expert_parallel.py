"""Routed experts over gloo ranks: a tiny V2-Lite-shaped model gives the single-process logits (fp32, allclose)
and greedy tokens with its experts split over "tp" (TP=2, no expert parallelism), spread whole over "ep" (EP=2
with TP=2; EP=2 over two data-parallel replicas; EP=4 over TP=2 x DP=2), and after the load balancer adds
redundant replicas and re-balances on the counted loads (experts move between ranks). A data-parallel replica
with no tokens still takes part in a MoE layer. Two multi-process runs (2 and 4 ranks) do every check.

Each replica drives its own prompt (prefill, then teacher-forced decode steps of the single-process greedy
tokens); the reference is the single-process model on that replica's prompts alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer.checkpoints import make_checkpoint
from deepinfer.models.registry import load_model
from deepinfer.parallel.local_ranks import run_local_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from paged_batch_util import PagedKV  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 12, 600], [8, 300, 2, 45, 77]]
DECODE_STEPS = 2
ATOL, RTOL = 2e-5, 1e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ep-model") / "tiny-v2-lite")
    make_checkpoint("tiny-v2-lite", path, seed=0)  # 8 experts top-2, 2 shared experts, 2 MoE layers
    return path


def _drive(model, prompts: list[list[int]], forced: list[list[int]] | None) -> dict:
    kv = PagedKV(model)
    chunks = list(enumerate(prompts))
    logits, argmax = [], []
    with torch.no_grad():
        for step in range(DECODE_STEPS + 1):
            batch = kv.batch(chunks)
            hidden = model.forward(batch, kv.caches)
            lg = model.compute_logits(hidden[batch.query_start_loc[1:] - 1])
            logits.append(lg)
            argmax.append(lg.argmax(-1).tolist())
            toks = argmax[-1] if forced is None else forced[step]
            chunks = [(i, [t]) for i, t in enumerate(toks)]
    return {"logits": logits, "argmax": argmax}


# ---------------------------------------------------------------- one rank's work


def _backend(tp: int, dp: int, ep: bool, rank: int):
    from rank_setup import rank_backend

    return rank_backend(tp, dp, ep, rank)


def _ep_rank(rank: int, world: int, path: str, refs: dict, cases: list) -> dict:
    from deepinfer.parallel.eplb import ExpertBalancer

    out: dict = {}
    for key, (tp, dp, ep, redundant, before) in cases:
        backend = _backend(tp, dp, ep, rank)
        model = load_model(path, backend, torch.float32, progress=False)
        replica = rank // tp
        prompts = PROMPTS if dp == 1 else [PROMPTS[replica]]
        ref = refs["both"] if dp == 1 else refs[f"p{replica}"]
        run = {"before": _drive(model, prompts, ref["argmax"]) if before else None}
        if redundant is not None:
            balancer = ExpertBalancer(model, backend, num_redundant=redundant)
            moe = model.layers[1].mlp
            run["slots"] = moe.placement.num_slots
            run["redundant"] = _drive(model, prompts, ref["argmax"])  # counts the loads, too
            run["counted"] = int(balancer.loads().sum())
            run["moved"] = balancer.rebalance()
            run["placement"] = moe.placement.slot_experts
            run["after"] = _drive(model, prompts, ref["argmax"])
        if dp > 1:  # a replica with no tokens takes part in the layer; the other gets its own rows right
            moe = model.layers[1].mlp
            x = torch.randn(3, moe.hidden_size, generator=torch.Generator().manual_seed(7))
            with torch.no_grad():
                y = moe(x if replica == 0 else x[:0])
            run["empty_replica"] = (tuple(y.shape), y if replica == 0 else None)
        out[key] = run
    return out


# ---------------------------------------------------------------- checks in the parent


def _refs(path: str) -> dict:
    from deepinfer.backends.cpu.backend import CPUBackend

    model = load_model(path, CPUBackend(), torch.float32, progress=False)
    refs = {"both": _drive(model, PROMPTS, None)}
    for i, p in enumerate(PROMPTS):
        refs[f"p{i}"] = _drive(model, [p], None)
    x = torch.randn(3, model.layers[1].mlp.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        refs["layer"] = model.layers[1].mlp(x)
    return refs


def _same(run: dict, ref: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(run["logits"], ref["logits"])):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, step=step: f"{what} step {step}: {m}")
    assert run["argmax"] == ref["argmax"], f"{what}: greedy tokens differ"


def _check(results: list[dict], refs: dict, cases: list) -> None:
    for key, (tp, dp, ep, redundant, before) in cases:
        for rank, res in enumerate(results):
            run = res[key]
            ref = refs["both"] if dp == 1 else refs[f"p{rank // tp}"]
            if before:
                _same(run["before"], ref, f"{key} rank {rank}")
            if redundant is not None:
                assert run["slots"] == 8 + redundant
                _same(run["redundant"], ref, f"{key} rank {rank} with {redundant} redundant slots")
                assert run["counted"] > 0
                assert run["moved"] > 0, f"{key}: the re-balance moved no expert"
                _same(run["after"], ref, f"{key} rank {rank} after the re-balance")
            if dp > 1:
                shape, y = run["empty_replica"]
                if rank // tp == 0:
                    torch.testing.assert_close(y, refs["layer"], atol=ATOL, rtol=RTOL)
                else:
                    assert shape == (0, refs["layer"].shape[1])
        if redundant is not None:  # every rank computed the same placement
            assert len({res[key]["placement"] for res in results}) == 1


# key: (tp, dp, expert parallel, EPLB redundant slots or None, drive before the balancer)
CASES_2 = [
    ("tp2", (2, 1, False, None, True)),  # experts split over tp (intermediate dim)
    ("ep2-tp2", (2, 1, True, None, True)),  # whole experts over the two tp ranks, shared experts tp-split
    ("ep2-dp2", (1, 2, True, 2, True)),  # two data-parallel replicas, experts over both; EPLB with 2 redundant
]
CASES_4 = [("ep4-tp2-dp2", (2, 2, True, 4, False))]  # 3 slots per rank: replicas spread over both replicas


def test_two_ranks_tp_ep_dp_and_rebalance(ckpt):
    refs = _refs(ckpt)
    results = run_local_ranks(_ep_rank, 2, ckpt, refs, CASES_2, timeout_s=240)
    _check(results, refs, CASES_2)


def test_four_ranks_ep_over_tp_and_dp_with_rebalance(ckpt):
    refs = _refs(ckpt)
    results = run_local_ranks(_ep_rank, 4, ckpt, refs, CASES_4, timeout_s=240)
    _check(results, refs, CASES_4)
