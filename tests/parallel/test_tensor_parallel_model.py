"""Tensor parallelism of the DeepSeek V2/V3 model on gloo ranks: logits equal to one process, each rank reads
only its part of the checkpoint, and the settings that cannot be split are named.

The single-process model drives a prefill + greedy decode; the ranks replay the same tokens (teacher forced)
through their sharded models and must give the same logits (fp32, tight tolerance: only the row-parallel
partial sums are added in another order) and the same argmax. One 2-rank run does every check (start-up
costs seconds); one 4-rank run checks a single preset at one head per rank. int4 (AWQ / GPTQ) checkpoints split
too, their experts kept int4 on every rank (GPTQ act-order ones too: each expert's intermediate sorted by its down
projection's groups, then cut); the int4 parts that cannot split (a group cut) are named with the layer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deepinfer.backend import SingleProcessCommunicator
from deepinfer.checkpoints import PRESETS, make_checkpoint
from deepinfer.checkpoints.random_weights import write_safetensors
from deepinfer.errors import ModelLoadError
from deepinfer.models.registry import load_model
from deepinfer.models.weights import OTHER_RANK

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from int4_ckpt_util import write_int4_pair
from mtp_checkpoint import with_mtp as _with_mtp
from paged_batch_util import PagedKV

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 12, 600], [8, 300, 2, 45, 77]]
DECODE_STEPS = 3
ATOL, RTOL = 2e-5, 1e-5


# ---------------------------------------------------------------- checkpoints (made once per module)


def _variant(root: str, preset: str, name: str, **changes) -> str:
    """A preset's config with `changes`, weights drawn from the preset's plan (no tokenizer: not needed)."""
    p = PRESETS[preset]
    cfg = {**p.hf_config(), **changes}
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_safetensors(out, p.tensor_plan(cfg, p.fp8), 0, torch.float32)
    return out


def _config_only(root: str, preset: str, name: str, **changes) -> str:
    """config.json alone: for errors raised before any tensor is read."""
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**PRESETS[preset].hf_config(), **changes}, f)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp-model"))
    out = {}
    for preset in ("tiny-v2-lite", "tiny-v3"):
        out[preset] = os.path.join(root, preset)
        make_checkpoint(preset, out[preset], seed=0)
    out["v3-mtp"] = _with_mtp(root, out["tiny-v3"], "v3-mtp")
    # no MoE layer, an odd vocabulary (the last rank's shard padded) and a tied head
    out["dense-tied"] = _variant(root, "tiny-v2-lite", "dense-tied", first_k_dense_replace=3, vocab_size=1001,
                                 tie_word_embeddings=True)
    # fp8 with every split part a whole number of 128-blocks per rank at tp=2 (q_b 2x128, kv_b 2x128, o_proj
    # 2x64 heads' columns = 128, MLP 256 -> 128, shared experts 256 -> 128, routed experts 256 -> 128)
    out["fp8-aligned"] = _variant(root, "tiny-v3-fp8", "fp8-aligned", qk_nope_head_dim=64, qk_rope_head_dim=64,
                                  v_head_dim=64, intermediate_size=512, moe_intermediate_size=256)
    # int4 (every decoder linear and expert, groups of 32: each rank's row-parallel part, o_proj 64, the MLP's
    # down 128, the experts' down 32, whole groups at tp=2), AWQ and GPTQ, GPTQ act-order; groups of 64 (the experts'
    # down 32 inputs a rank, half a group) are refused naming the layer
    for name, method, group, act in (("int4-awq", "awq", 32, False), ("int4-gptq", "gptq", 32, False),
                                     ("int4-act-order", "gptq", 32, True), ("int4-g64", "awq", 64, False)):
        out[name] = os.path.join(root, name)
        write_int4_pair(out["tiny-v3"], out[name], os.path.join(root, f"{name}-twin"), method, group, act_order=act)
    out["heads-3"] = _config_only(root, "tiny-v2-lite", "heads-3", num_attention_heads=3, num_key_value_heads=3)
    # q_b_proj: 2 heads x (32 + 64) = 192 rows per rank, not whole 128-blocks (the experts align)
    out["fp8-misaligned"] = _config_only(root, "tiny-v3-fp8", "fp8-misaligned", qk_nope_head_dim=32,
                                         qk_rope_head_dim=64, v_head_dim=64, intermediate_size=512,
                                         moe_intermediate_size=256)
    return out


# ---------------------------------------------------------------- driving a model by hand


def _drive(model, forced: list[list[int]] | None, mtp: bool = False) -> dict:
    """Prefill both prompts in one batch, then DECODE_STEPS decode steps of both sequences. forced: the tokens
    to feed at each decode step (None: the greedy argmax). Returns the logits of every step, the argmax of
    each and, with mtp, the MTP module's logits over the prefill."""
    specs = model.kv_cache_specs(include_mtp=True) if mtp else None
    kv = PagedKV(model, specs=specs)
    chunks = list(enumerate(PROMPTS))
    logits, argmax, fed = [], [], []
    with torch.no_grad():
        for step in range(DECODE_STEPS + 1):
            batch = kv.batch(chunks)
            hidden = model.forward(batch, kv.caches)
            last = batch.query_start_loc[1:] - 1
            lg = model.compute_logits(hidden[last])
            if mtp and step == 0:
                nxt = torch.tensor([t for p in PROMPTS for t in p[1:] + [0]])  # the token after each position
                mtp_logits = model.mtp_logits(model.mtp_forward(hidden, nxt, batch, kv.caches))
            logits.append(lg)
            argmax.append(lg.argmax(-1).tolist())
            toks = argmax[-1] if forced is None else forced[step]
            fed.append(toks)
            chunks = [(i, [t]) for i, t in enumerate(toks)]
    out = {"logits": logits, "argmax": argmax, "fed": fed}
    if mtp:
        out["mtp_logits"] = mtp_logits
    return out


def _load_error(path: str, backend) -> str:
    """The error loading `path` on this rank raises (type and message), or "no error"."""
    try:
        load_model(path, backend, torch.float32, progress=False)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# ---------------------------------------------------------------- one rank's work


def _tp_rank(rank: int, world: int, phases: list[tuple[int, dict, dict]]) -> list[dict]:
    """Per phase (tp, cases, errors): this world laid out as tp x (world / tp), every case loaded and replayed,
    every error case's message."""
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.loader import ReadStats
    from deepinfer.parallel.groups import build_communicators
    from deepinfer.parallel.layout import ParallelLayout

    results = []
    for tp, cases, errors, *ep in phases:  # ep: [True] spreads the routed experts (whole) over every rank
        backend = CPUBackend()
        layout = ParallelLayout(tensor_parallel_size=tp, data_parallel_size=world // tp,
                                enable_expert_parallel=bool(ep and ep[0]))
        backend.install_communicators(build_communicators(layout, rank, backend))
        out: dict = {}
        for key, (path, mtp, forced) in cases.items():
            stats = ReadStats()
            model = load_model(path, backend, torch.float32, progress=False, load_mtp=mtp, read_stats=stats)
            run = _drive(model, forced, mtp)
            run["reads"] = stats.shapes
            run["int4_experts"] = [m.op.quant.scheme for m in model.modules()
                                   if getattr(m, "quantized_experts", False) and m.op.quant is not None]
            run["bytes"] = stats.bytes_read
            run["sorted_cuts"] = sum(m.experts.num_sorted_cuts for m in model.modules()
                                     if hasattr(getattr(m, "experts", None), "num_sorted_cuts"))
            out[key] = run
        for key, path in errors.items():
            out[key] = _load_error(path, backend)
        results.append(out)
    return results


# ---------------------------------------------------------------- checks in the parent


def _reference(path: str, mtp: bool = False) -> dict:
    from deepinfer.backends.cpu.backend import CPUBackend

    return _drive(load_model(path, CPUBackend(), torch.float32, progress=False, load_mtp=mtp), None, mtp)


def _stored(path: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 - a safe_open handle is no dict
                    shapes[k] = tuple(h.get_slice(k).get_shape())
    return shapes


def _check_same_logits(ref: dict, runs: list[dict], key: str) -> None:
    for rank, run in enumerate(runs):
        assert run["fed"] == ref["fed"], f"{key} rank {rank}: the replay fed other tokens"
        for step, (a, b) in enumerate(zip(run["logits"], ref["logits"])):
            where = f"{key} rank {rank} step {step}"
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, where=where: f"{where}: {m}")
        assert run["argmax"] == ref["argmax"], f"{key} rank {rank}: greedy tokens differ"
        if "mtp_logits" in ref:
            torch.testing.assert_close(run["mtp_logits"], ref["mtp_logits"], atol=ATOL, rtol=RTOL)
    for step in range(len(ref["logits"])):  # every tp rank sees bit-identical logits (they were gathered)
        assert all(torch.equal(r["logits"][step], runs[0]["logits"][step]) for r in runs)


def _check_reads(path: str, runs: list[dict], split_names: list[str], whole_names: list[str]) -> None:
    """Each rank read each tensor at most once; a tensor is either read whole by every rank, or split along one
    dim into parts that tile it (sizes summing to the stored size); the named tensors are split / whole."""
    stored = _stored(path)
    world = len(runs)
    split = set()
    for name, shape in stored.items():
        got = [r["reads"].get(name) for r in runs]
        for rank, g in enumerate(got):
            assert g is None or len(g) == 1, f"rank {rank} read {name} {len(g)} times"
        parts = [g[0] for g in got if g is not None]
        if not parts:
            continue
        assert len(parts) == world, f"{name}: read by {len(parts)} of {world} ranks"
        if all(p == shape for p in parts):
            continue
        dims = {d for p in parts for d in range(len(shape)) if p[d] != shape[d]}
        assert len(dims) == 1, f"{name}: parts {parts} of {shape}"
        (d,) = dims
        assert sum(p[d] for p in parts) == shape[d], f"{name}: parts {parts} do not tile {shape}"
        split.add(name)
    for name in split_names:
        assert name in split, f"{name} was not split (read whole by every rank)"
    for name in whole_names:
        assert name in stored and name not in split, f"{name} should be read whole by every rank"
    total = sum(torch.Size(s).numel() for s in stored.values())  # elements; bytes below use the dtype
    for r in runs:
        assert r["bytes"] > 0 and sum(torch.Size(s[0]).numel() for s in r["reads"].values()) < total


_ATTN_SPLIT = ["model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.o_proj.weight",
               "model.embed_tokens.weight"]
TP2_CASES = {"v2-lite": ("tiny-v2-lite", False), "v3-mtp": ("v3-mtp", True), "dense-tied": ("dense-tied", False),
             "fp8-aligned": ("fp8-aligned", False), "int4-awq": ("int4-awq", False), "int4-gptq": ("int4-gptq", False),
             "int4-act-order": ("int4-act-order", False)}
TP4_CASES = {"v2-lite": ("tiny-v2-lite", False)}


@pytest.fixture(scope="module")
def tp_runs(ckpts):
    """One 4-rank run (process start-up is the cost): phase 0 at TP=2 x DP=2 (two replicas of the TP=2 model,
    every check), phase 1 at TP=4 (one head per rank). Returns (single-process references, per-rank results)."""
    from deepinfer.parallel.local_ranks import run_local_ranks

    keys = {**TP2_CASES, **TP4_CASES}
    ref = {k: _reference(ckpts[c], m) for k, (c, m) in keys.items()}
    tp2 = {k: (ckpts[c], m, ref[k]["fed"]) for k, (c, m) in TP2_CASES.items()}
    tp4 = {k: (ckpts[c], m, ref[k]["fed"]) for k, (c, m) in TP4_CASES.items()}
    errors = {"heads": ckpts["heads-3"], "fp8": ckpts["fp8-misaligned"], "int4-g64": ckpts["int4-g64"]}
    tp2_ep = {"int4-act-order": (ckpts["int4-act-order"], False, ref["int4-act-order"]["fed"])}
    return ref, run_local_ranks(_tp_rank, 4, [(2, tp2, errors), (4, tp4, {}), (2, tp2_ep, {}, True)], timeout_s=400)


def _group(runs: list[list[dict]], phase: int, ranks: range, key: str) -> list[dict]:
    return [runs[r][phase][key] for r in ranks]


@pytest.mark.parametrize("key", sorted(TP2_CASES))
def test_tp2_logits_equal_one_process(tp_runs, key):
    ref, runs = tp_runs
    for replica in (range(2), range(2, 4)):  # both data-parallel replicas of the TP=2 model
        _check_same_logits(ref[key], _group(runs, 0, replica, key), f"{key} tp=2 ranks {list(replica)}")


def test_tp2_int4_checkpoints_keep_their_experts_int4(tp_runs, ckpts):
    """The int4 cases above ran their routed experts int4 on every rank (the cpu op keeps them), not densified."""
    _, runs = tp_runs
    with open(os.path.join(ckpts["int4-act-order"], "config.json")) as f:
        experts = json.load(f)["n_routed_experts"]
    for key, scheme in (("int4-awq", "int4_awq"), ("int4-gptq", "int4_gptq"), ("int4-act-order", "int4_gptq")):
        for run in _group(runs, 0, range(4), key):
            assert run["int4_experts"] == [scheme, scheme], (key, run["int4_experts"])  # tiny-v3's 2 MoE layers
            # GPTQ act-order: every routed expert's intermediate sorted by its down projection's groups, then cut
            assert run["sorted_cuts"] == (2 * experts if key == "int4-act-order" else 0), (key, run["sorted_cuts"])


def test_tp2_with_expert_parallel_takes_an_act_order_checkpoint(tp_runs):
    """GPTQ act-order at TP=2 x DP=2 with the routed experts spread whole over the 4 ranks (expert parallelism): the
    dense linears' row parts keep every group's zero points and scales (Int4Weight.part), and the logits and greedy
    tokens are one process's."""
    ref, runs = tp_runs
    for replica in (range(2), range(2, 4)):
        _check_same_logits(ref["int4-act-order"], _group(runs, 2, replica, "int4-act-order"),
                           f"int4-act-order tp=2 + ep ranks {list(replica)}")


def test_tp4_one_head_per_rank_logits_equal_one_process(tp_runs):
    ref, runs = tp_runs
    _check_same_logits(ref["v2-lite"], _group(runs, 1, range(4), "v2-lite"), "v2-lite tp=4")


def test_each_rank_reads_only_its_part(tp_runs, ckpts):
    _, runs = tp_runs
    tp2 = range(2)
    mlp0 = [f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    _check_reads(ckpts["tiny-v2-lite"], _group(runs, 0, tp2, "v2-lite"),
                 _ATTN_SPLIT + mlp0 + ["model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
                                       "model.layers.1.mlp.shared_experts.down_proj.weight"],
                 ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.norm.weight",
                  "model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.1.mlp.gate.weight"])
    _check_reads(ckpts["v3-mtp"], _group(runs, 0, tp2, "v3-mtp"),
                 _ATTN_SPLIT + ["model.layers.0.self_attn.q_b_proj.weight", "model.layers.3.self_attn.o_proj.weight",
                                "model.layers.3.shared_head.head.weight"],
                 ["model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_a_layernorm.weight",
                  "model.layers.3.eh_proj.weight"])
    _check_reads(ckpts["fp8-aligned"], _group(runs, 0, tp2, "fp8-aligned"),
                 _ATTN_SPLIT + ["model.layers.0.self_attn.q_b_proj.weight_scale_inv",
                                "model.layers.0.self_attn.o_proj.weight_scale_inv",
                                "model.layers.0.mlp.down_proj.weight_scale_inv"],
                 ["model.layers.0.self_attn.q_a_proj.weight_scale_inv"])
    _check_reads(ckpts["tiny-v2-lite"], _group(runs, 1, range(4), "v2-lite"), _ATTN_SPLIT + mlp0, [])
    # the tied head: only the embedding is read, each rank its ceil(1001 / 2) = 501 or the last 500 rows
    assert [r["reads"]["model.embed_tokens.weight"] for r in _group(runs, 0, tp2, "dense-tied")] == \
        [[(501, 128)], [(500, 128)]]
    assert "lm_head.weight" not in runs[0][0]["dense-tied"]["reads"]


def test_settings_that_cannot_split_are_named(tp_runs):
    _, runs = tp_runs
    for r in runs:
        heads, fp8 = r[0]["heads"], r[0]["fp8"]
        assert heads.startswith("ModelLoadError") and "num_attention_heads 3" in heads, heads
        assert "tensor_parallel_size 2" in heads, heads
        assert fp8.startswith("ModelLoadError") and "tensor_parallel_size 2" in fp8, fp8
        assert "model.layers.0.self_attn.q_b_proj" in fp8 and "128" in fp8, fp8
        g64 = r[0]["int4-g64"]
        assert g64.startswith("ModelLoadError") and "group of 64" in g64 and "down_proj" in g64, g64
        assert "tensor_parallel_size 2" in g64, g64


# ---------------------------------------------------------------- layer-level checks, in this process


class _RankOf(SingleProcessCommunicator):
    """A stand-in "tp" communicator that reports rank `rank` of `world` (only loaders are exercised: no
    collective is called)."""

    def __init__(self, rank: int, world: int):
        self._rank, self._world = rank, world

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world


def test_split_layers_take_their_part_of_int4_and_int8_records():
    """A column- / row-parallel Linear handed a whole int4 / int8 record keeps its rank's part: the ranks' dense
    weights tile the whole record's (through the cpu backend's linear methods)."""
    from deepinfer.backend import Int4Weight
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.checkpoints.awq_writer import pack_awq_cols, quantize_int4
    from deepinfer.models.layers.linear import Linear
    from deepinfer.models.loader import Int8Weight, deliver

    be = CPUBackend()
    q, z, s = quantize_int4(torch.randn(256, 128, generator=torch.Generator().manual_seed(0)), 64)
    int4 = Int4Weight("awq", pack_awq_cols(q), pack_awq_cols(z), s, group_size=64)
    int8 = Int8Weight(torch.randint(-127, 128, (256, 128), dtype=torch.int8), torch.rand(256, 1) + 0.5,
                      torch.zeros(256, 1))
    for rec in (int4, int8):
        whole = Linear(128, 256, be, torch.float32, split="column", tp=_RankOf(0, 1))
        (load,) = whole.loaders("w").values()
        deliver(load, rec)
        want = whole.dense()
        for split, dim in (("column", 0), ("row", 1)):
            parts = []
            for rank in range(2):
                lin = Linear(128, 256, be, torch.float32, split=split, tp=_RankOf(rank, 2))
                (load,) = lin.loaders("model.layers.0.mlp.gate_proj").values()
                deliver(load, rec)
                assert lin.scheme() == rec.scheme
                parts.append(lin.dense())
            torch.testing.assert_close(torch.cat(parts, dim), want, atol=0, rtol=0, msg=f"{rec.scheme} {split}")
    # a part that splits a quantization group is refused naming the layer (4 ranks x 32 inputs, groups of 64)
    lin = Linear(128, 256, be, torch.float32, split="row", tp=_RankOf(1, 4))
    (load,) = lin.loaders("model.layers.0.mlp.down_proj").values()
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight \(row-parallel over tensor_parallel_size 4\).*"
                                             r"group of 64"):
        deliver(load, int4)


def test_row_parallel_bias_is_read_on_rank_zero_only_and_parts_tile_the_weight():
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.layers.linear import Linear
    from deepinfer.models.loader import deliver

    be = CPUBackend()
    w, b = torch.randn(8, 6), torch.randn(8)
    got = []
    for rank in range(2):
        lin = Linear(6, 8, be, torch.float32, bias=True, split="row", tp=_RankOf(rank, 2))
        loads = lin.loaders("o_proj")
        assert (loads["o_proj.bias"] is OTHER_RANK) == (rank == 1)
        deliver(loads["o_proj.weight"], w)
        deliver(loads["o_proj.bias"], b)
        got.append(lin)
    torch.testing.assert_close(torch.cat([g.weight for g in got], dim=1), w, rtol=0, atol=0)
    assert torch.equal(got[0].bias, b) and got[1].bias is None
    with pytest.raises(ModelLoadError, match=r"o_proj: .*in_features 6 does not split evenly over tensor_parallel_size 4"):
        Linear(6, 8, be, torch.float32, split="row", tp=_RankOf(0, 4)).loaders("o_proj")


def _gptq(out_f: int, in_f: int, group: int, act_order: bool, seed: int):
    from deepinfer.backend import Int4Weight
    from deepinfer.checkpoints.awq_writer import pack_gptq, quantize_int4

    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(in_f, generator=g) if act_order else torch.arange(in_f)
    inv = torch.argsort(perm)
    q, z, s = quantize_int4(torch.randn(out_f, in_f, generator=g)[:, perm], group)
    qweight, qzeros = pack_gptq(q[inv], z)
    return Int4Weight("gptq", qweight, qzeros, s, g_idx=(inv // group).to(torch.int32), group_size=group,
                      zero_offset=1)


def _expert_parts(records: dict, tp: int, inter: int, hidden: int = 64):
    """Each rank's dense (w13, w2) of one routed expert handed the whole records (ExpertWeights, tp ranks)."""
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.layers.experts import ExpertWeights
    from deepinfer.models.loader import deliver

    out = []
    for rank in range(tp):
        ew = ExpertWeights(1, hidden, inter // tp, CPUBackend(), torch.float32, False,
                           ("gate_proj", "up_proj", "down_proj"), tp_part=(rank, tp))
        loaders = ew.loaders("model.layers.1.mlp")
        for proj, rec in records.items():
            deliver(loaders[f"model.layers.1.mlp.experts.0.{proj}.weight"], rec)
        out.append(ew.stacked())
    return out


def test_act_order_experts_sorted_then_cut_compute_the_whole_expert():
    """GPTQ act-order routed experts under TP without expert parallelism: each rank's part (the intermediate sorted by
    the down projection's groups, then cut) computes its share, and the ranks' sum is the whole expert's output; a
    down projection whose gate / up are not act-order, and a sorted cut through a group, are refused naming why."""
    from deepinfer.backend import dequant_int4

    hidden, inter, group = 64, 128, 32
    recs = {"gate_proj": _gptq(inter, hidden, group, True, 1), "up_proj": _gptq(inter, hidden, group, True, 2),
            "down_proj": _gptq(hidden, inter, group, True, 3)}
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(9))
    wg, wu, wd = (dequant_int4(recs[p]) for p in ("gate_proj", "up_proj", "down_proj"))
    want = (torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t())) @ wd.t()
    for tp in (2, 4):
        got = 0
        for w13, w2 in _expert_parts(recs, tp, inter):
            i = w2.shape[2]
            got = got + (torch.nn.functional.silu(x @ w13[0, :i].t()) * (x @ w13[0, i:].t())) @ w2[0].t()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"tp={tp}")
    mixed = {**recs, "gate_proj": _gptq(inter, hidden, group, False, 1), "up_proj": _gptq(inter, hidden, group, False, 2)}
    with pytest.raises(ModelLoadError, match="down projection is GPTQ act-order but the gate / up"):
        _expert_parts(mixed, 2, inter)
    with pytest.raises(ModelLoadError, match=r"down_proj \(its inputs sorted by group\).*split a quantization group"):
        _expert_parts(recs, 8, inter)  # 16 inputs a rank, half a group of 32
