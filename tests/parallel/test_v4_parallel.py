"""DeepSeek-V4 over gloo ranks: the tiny-v4 preset (SWA, CSA with the lightning indexer, HCA, a hash-routed and
sqrtsoftplus-routed MoE, hyper-connections) gives the single-process logits (fp32, tight allclose) and greedy
tokens with its heads split over "tp" and its experts split over "tp" (TP=2), spread over "ep" (EP=2 on the two
tp ranks), over TP=2 x DP=2 with experts over the 4 ranks (hash-routed token ids gathered over "dp" with the
hidden states), and after the load balancer adds replicas and moves experts; each rank reads only its part of the split tensors; uneven splits are errors
naming the setting. Built with its MTP module (load_mtp), TP=2 and TP=2 with EP give the single-process MTP
logits too (the pass over both prompts, then a chain link): the module's block splits like a main layer's.

Each replica drives its own prompt through the model directly (tests/v4's paged runner: prefill, then decode
steps teacher-forced with the single-process greedy tokens); the reference is the single-process model on that
replica's prompts alone. One 2-rank and one 4-rank run do every check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer.checkpoints.presets_v4 import tiny_v4_config
from deepinfer.models.registry import load_model
from deepinfer.parallel.local_ranks import run_local_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "v4"))
from v4_helpers import PagedRunner

# 22 tokens: past the window (8), one HCA entry (m=16), five CSA entries (m=4) so the indexer's top-4 selects
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 12, 600, 33, 2, 870, 64, 9, 401, 15, 77, 128, 3, 950, 21, 6],
           [8, 300, 2, 45, 77, 19, 1000, 4, 51, 66, 23, 700, 11, 5, 89, 240, 13, 31]]
DECODE_STEPS = 3
ATOL, RTOL = 2e-5, 1e-5


def _drive(model, prompts: list[list[int]], forced: list[list[int]] | None) -> dict:
    """Last-row logits of a prefill and DECODE_STEPS decodes (tokens: `forced`, else the greedy ones)."""
    runner = PagedRunner(model)
    for rid in range(len(prompts)):
        runner.add(rid)
    chunks = list(enumerate(prompts))
    logits, argmax = [], []
    for step in range(DECODE_STEPS + 1):
        lg = runner.step(chunks)
        ends = torch.tensor([len(t) for _, t in chunks]).cumsum(0) - 1
        lg = lg[ends]
        logits.append(lg)
        argmax.append(lg.argmax(-1).tolist())
        toks = argmax[-1] if forced is None else forced[step]
        chunks = [(i, [t]) for i, t in enumerate(toks)]
    return {"logits": logits, "argmax": argmax}


def _drive_mtp(model, prompts: list[list[int]], nxt: list[int]) -> torch.Tensor:
    """The MTP module's logits over both prompts in one step (next token of each prompt's last row: nxt), then one
    chain link a position further from its own state, each prompt's last row (draft token 7)."""
    runner = PagedRunner(model, specs=model.kv_cache_specs(include_mtp=True))
    for rid in range(len(prompts)):
        runner.add(rid)
    chunks = list(enumerate(prompts))
    batch = runner.batch(chunks)
    hidden = model(batch, runner.caches)
    next_ids = torch.tensor([t for p, n in zip(prompts, nxt) for t in p[1:] + [n]])
    state = model.mtp_forward(model.mtp_input(hidden), next_ids, batch, runner.caches)
    runner.advance(chunks)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    link = runner.batch([(i, [7]) for i in range(len(prompts))])
    chain = model.mtp_forward(state[ends], torch.full((len(prompts),), 7), link, runner.caches)
    return torch.cat([model.mtp_logits(state), model.mtp_logits(chain)])


# ---------------------------------------------------------------- one rank's work


def _backend(tp: int, dp: int, ep: bool, rank: int):
    from rank_setup import rank_backend

    return rank_backend(tp, dp, ep, rank)


def _error(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _rank(rank: int, world: int, path: str, refs: dict, cases: list, bad: list, mtp_cases: list = ()) -> dict:
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from deepinfer.models.loader import ReadStats
    from deepinfer.parallel.eplb import ExpertBalancer

    out: dict = {}
    for key, (tp, dp, ep, redundant) in cases:
        backend = _backend(tp, dp, ep, rank)
        stats = ReadStats()
        model = load_model(path, backend, torch.float32, progress=False, read_stats=stats)
        replica = rank // tp
        prompts = PROMPTS if dp == 1 else [PROMPTS[replica]]
        ref = refs["both"] if dp == 1 else refs[f"p{replica}"]
        run = {"drive": _drive(model, prompts, ref["argmax"]),
               "read": {n: stats.shapes.get(n) for n in ("layers.1.attn.wq_b.weight", "layers.1.attn.attn_sink",
                                                         "layers.1.attn.wo_a.weight", "layers.1.attn.wo_b.weight",
                                                         "layers.1.attn.indexer.wq_b.weight",
                                                         "layers.1.ffn.experts.0.w1.weight",
                                                         "layers.1.ffn.experts.7.w1.weight")},
               "mtp_kept": len(model.mtp_weights), "mtp_skipped": model.skipped_mtp_tensors}
        if redundant is not None:  # the load balancer on V4's layers: replicas, counted loads, moved experts
            balancer = ExpertBalancer(model, backend, num_redundant=redundant)
            run["slots"] = model.layers[1].ffn.placement.num_slots
            run["redundant"] = _drive(model, prompts, ref["argmax"])
            run["counted"] = int(balancer.loads().sum())
            run["moved"] = balancer.rebalance()
            run["placements"] = [layer.ffn.placement.slot_experts for layer in model.layers]
            run["after"] = _drive(model, prompts, ref["argmax"])
        out[key] = run
    for key, (tp, dp, ep) in mtp_cases:  # the MTP module split like the main layers
        model = load_model(path, _backend(tp, dp, ep, rank), torch.float32, progress=False, load_mtp=True)
        out[f"mtp-{key}"] = _drive_mtp(model, PROMPTS, refs["both"]["argmax"][0])
    for key, (tp, dp, ep, changes) in bad:  # settings that do not split: raised while the model is built
        backend = _backend(tp, dp, ep, rank)
        out[key] = _error(DeepseekV4ForCausalLM, {**tiny_v4_config(), **changes}, backend, torch.float32)
    return out


# ---------------------------------------------------------------- checks in the parent


@pytest.fixture(scope="module")
def ckpt(checkpoint) -> str:
    return checkpoint("tiny-v4")


@pytest.fixture(scope="module")
def refs(ckpt) -> dict:
    from deepinfer.backends.cpu.backend import CPUBackend

    model = load_model(ckpt, CPUBackend(), torch.float32, progress=False)
    out = {"both": _drive(model, PROMPTS, None)}
    for i, p in enumerate(PROMPTS):
        out[f"p{i}"] = _drive(model, [p], None)
    out["mtp_kept"] = len(model.mtp_weights)
    with_mtp = load_model(ckpt, CPUBackend(), torch.float32, progress=False, load_mtp=True)
    out["mtp"] = _drive_mtp(with_mtp, PROMPTS, out["both"]["argmax"][0])
    return out


def _same(run: dict, ref: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(run["logits"], ref["logits"], strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, s=step: f"{what} step {s}: {m}")
    assert run["argmax"] == ref["argmax"], f"{what}: greedy tokens differ"


def _check(results: list[dict], refs: dict, cases: list) -> None:
    cfg = tiny_v4_config()
    H, D, G, ol, inter = (cfg["num_attention_heads"], cfg["head_dim"], cfg["o_groups"], cfg["o_lora_rank"],
                          cfg["moe_intermediate_size"])
    ql, Hi, Di, Dm = cfg["q_lora_rank"], cfg["index_n_heads"], cfg["index_head_dim"], cfg["hidden_size"]
    for key, (tp, dp, ep, redundant) in cases:
        for rank, res in enumerate(results):
            run = res[key]
            ref = refs["both"] if dp == 1 else refs[f"p{rank // tp}"]
            _same(run["drive"], ref, f"{key} rank {rank}")
            read = run["read"]
            # heads: this rank's rows of wq_b / sinks / wo_a, columns of wo_b; the indexer whole (replicated)
            assert read["layers.1.attn.wq_b.weight"] == [(H // tp * D, ql)], key
            assert read["layers.1.attn.attn_sink"] == [(H // tp,)], key
            assert read["layers.1.attn.wo_a.weight"] == [(G // tp * ol, H * D // G)], key
            assert read["layers.1.attn.wo_b.weight"] == [(Dm, G // tp * ol)], key
            assert read["layers.1.attn.indexer.wq_b.weight"] == [(Hi * Di, ql)], key
            if ep:  # whole experts, only this rank's (loaded contiguous: E / world per rank)
                per = cfg["n_routed_experts"] // len(results)
                for e in (0, 7):
                    got = read[f"layers.1.ffn.experts.{e}.w1.weight"]
                    assert got == ([(inter, Dm)] if e // per == rank else None), (key, rank, e, got)
            else:  # every expert's slice of the intermediate dimension
                assert read["layers.1.ffn.experts.0.w1.weight"] == [(inter // tp, Dm)], key
            assert run["mtp_kept"] == 0 and run["mtp_skipped"] > 0, f"{key}: MTP tensors are not read on many ranks"
            if redundant is not None:
                assert run["slots"] == cfg["n_routed_experts"] + redundant
                _same(run["redundant"], ref, f"{key} rank {rank} with {redundant} redundant slots")
                assert run["counted"] > 0
                assert run["moved"] > 0, f"{key}: the re-balance moved no expert"
                _same(run["after"], ref, f"{key} rank {rank} after the re-balance")
        if redundant is not None:  # every rank computed the same placements
            assert len({tuple(res[key]["placements"]) for res in results}) == 1


# key: (tp, dp, expert parallel, EPLB redundant slots or None)
CASES_2 = [
    ("tp2", (2, 1, False, None)),  # heads and experts' intermediate dim over tp
    ("tp2-ep2", (2, 1, True, None)),  # heads over tp, whole experts over the same two ranks
]
BAD_2 = [  # key: (tp, dp, ep, config changes) -> the setting the error must name
    ("heads", (2, 1, False, {"num_attention_heads": 3, "o_groups": 1})),
    ("groups", (2, 1, False, {"o_groups": 1})),
    ("experts", (2, 1, True, {"n_routed_experts": 3, "num_experts_per_tok": 1})),
]
CASES_4 = [("tp2-dp2-ep4", (2, 2, True, 4))]  # experts over 4 ranks, 3 slots each after EPLB's replicas
BAD_4 = [("groups-tp4", (4, 1, False, {}))]  # the preset's o_groups 2 over 4 ranks


MTP_CASES_2 = [("tp2", (2, 1, False)), ("tp2-ep2", (2, 1, True))]


def test_two_ranks_tp_ep_dp_and_bad_splits(ckpt, refs):
    assert refs["mtp_kept"] > 0  # one process keeps the MTP tensors aside, as before
    results = run_local_ranks(_rank, 2, ckpt, refs, CASES_2, BAD_2, MTP_CASES_2, timeout_s=240)
    _check(results, refs, CASES_2)
    for key, _ in MTP_CASES_2:
        for rank, res in enumerate(results):
            torch.testing.assert_close(res[f"mtp-{key}"], refs["mtp"], atol=ATOL, rtol=RTOL,
                                       msg=lambda m, k=key, r=rank: f"MTP {k} rank {r}: {m}")
    for res in results:
        assert "num_attention_heads 3" in res["heads"] and "tensor_parallel_size 2" in res["heads"], res["heads"]
        assert "o_groups 1" in res["groups"] and "tensor_parallel_size 2" in res["groups"], res["groups"]
        assert "n_routed_experts 3" in res["experts"] and "2 expert-parallel ranks" in res["experts"], res["experts"]


def test_four_ranks_tp2_dp2_experts_over_four_with_rebalance(ckpt, refs):
    results = run_local_ranks(_rank, 4, ckpt, refs, CASES_4, BAD_4, timeout_s=240)
    _check(results, refs, CASES_4)
    for res in results:
        assert "o_groups 2" in res["groups-tp4"] and "tensor_parallel_size 4" in res["groups-tp4"], res["groups-tp4"]
