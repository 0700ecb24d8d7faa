"""Context-parallel prefill (parallel/context_parallel.py, cp_batch.py, cp_forward.py, models/layers/cp_attention.py)
on gloo ranks: the zigzag split, the model's logits against one process, the engine's greedy and seeded
tokens against one process with chunked prefill and prefix caching, and the start-up refusals.

The model-level run drives V2-Lite and V3 presets by hand (tests/models/paged_batch_util.py): a 300-token
prompt prefilled in two chunks (the second on top of a cached context) beside a 37-token and a 3-token prompt,
then decode steps. Every rank must give logits within fp32 rounding of one process for every token and the
same argmax; the ranks' logits and KV caches must be bit-identical (split steps and whole steps alike).

Run as a script (`python test_context_parallel.py engine CKPT JSON`) it builds a parallel engine in its own
process (the test process never joins a process group) and prints `RESULT {...}`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from paged_batch_util import PagedKV

ATOL, RTOL = 2e-5, 1e-5
_rng = random.Random(19)
PROMPTS = [[_rng.randrange(1, 1000) for _ in range(n)] for n in (300, 37, 3)]
# per step, per sequence: (start, end) of its prompt to prefill, or None for a decode of the last greedy token
SCHEDULE = [[(0, 200), (0, 37), (0, 3)], [(200, 300), None, None], [None, None, None], [None, None, None]]
SPLIT_STEPS = 2  # steps 0 and 1 carry >= MIN_TOKENS prefill tokens; the decode steps run whole
MIN_TOKENS = 64
MODEL_PRESETS = ("tiny-v2-lite", "tiny-v3")


# ---------------------------------------------------------------- the split itself (pure)


def test_zigzag_split_covers_every_token_once_and_balances_causal_work():
    from deepinfer.parallel.context_parallel import plan_context_parallel, zigzag_bounds, zigzag_segments

    assert zigzag_bounds(10, 2) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [(s.start, s.length) for s in zigzag_segments(0, 10, 2, 0)] == [(0, 3), (8, 2)]
    assert [(s.start, s.length) for s in zigzag_segments(0, 10, 2, 1)] == [(3, 5)]  # chunks 1 and 2 touch: merged
    for n, cp in ((300, 2), (301, 4), (8, 4), (1000, 3)):
        plan = plan_context_parallel([n], cp, 1)
        rows = sorted(r for rank_rows in plan.rows for r in rank_rows)
        assert rows == list(range(n)), f"n={n} cp={cp}: not every token exactly once"
        work = [sum(p + 1 for p in rank_rows) for rank_rows in plan.rows]  # causal attention: p + 1 keys
        # within two tokens' worth of keys (the remainder tokens land on a few chunks)
        assert max(work) - min(work) <= 2 * n, (n, cp, work)
        naive = [sum(p + 1 for p in range(r * n // cp, (r + 1) * n // cp)) for r in range(cp)]
        assert max(work) < max(naive)  # better than cutting the prompt into cp contiguous pieces
    # decodes and short prefills go whole to the lightest rank; rows keep batch order within a rank
    plan = plan_context_parallel([1, 40, 1, 3], 2, 16)
    assert sorted(r for rr in plan.rows for r in rr) == list(range(45))
    assert all(rr == sorted(rr) for rr in plan.rows)
    assert {len(rr) for rr in plan.rows} == {22, 23}
    # not split: too few prefill tokens, cp of one, or no request long enough to give every rank a share
    assert plan_context_parallel([40, 1], 2, 64) is None
    assert plan_context_parallel([400], 1, 1) is None
    assert plan_context_parallel([3, 3, 1], 2, 1) is None


# ---------------------------------------------------------------- the model on cp ranks


def _drive(model, hidden_fn, forced: list[list[int]] | None = None) -> dict:
    """Run SCHEDULE. hidden_fn(batch, kv) -> the hidden states of batch.logits_indices' rows (every row here).
    forced: the decode tokens to feed (None: the greedy argmax). Returns every step's logits (every token),
    the greedy token of each sequence per step, the tokens fed, and each sequence's KV entries per layer."""
    kv = PagedKV(model, num_blocks=64, block_size=16)
    logits, argmax, fed = [], [], []
    last: list[int] = []
    with torch.no_grad():
        for step, plan in enumerate(SCHEDULE):
            toks = [PROMPTS[i][p[0]:p[1]] if p is not None else [(forced[step][i] if forced else last[i])]
                    for i, p in enumerate(plan)]
            fed.append([t[-1] for t in toks])
            batch = kv.batch(list(enumerate(toks)))
            lg = model.compute_logits(hidden_fn(batch, kv)).float()
            logits.append(lg)
            ends = batch.query_start_loc[1:].tolist()
            last = [int(lg[e - 1].argmax()) for e in ends]
            argmax.append(last)
    entries = []
    for layer in range(model.num_layers):
        cache = kv.caches.get("mla", layer).view(-1, kv.caches.get("mla", layer).shape[-1])
        per_seq = []
        for sid in range(len(PROMPTS)):
            slots = [kv.blocks[sid][p // 16] * 16 + p % 16 for p in range(kv.lens[sid])]
            per_seq.append(cache[torch.tensor(slots)].clone())
        entries.append(per_seq)
    return {"logits": logits, "argmax": argmax, "fed": fed, "entries": entries}


def _cp_rank(rank: int, world: int, paths: dict[str, str], forced: dict[str, list[list[int]]]) -> dict:
    """This rank of a cp=world replica: every preset driven through ContextParallelForward."""
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.registry import load_model
    from deepinfer.parallel.cp_forward import ContextParallelForward
    from deepinfer.parallel.groups import build_communicators, build_cp_communicator
    from deepinfer.parallel.layout import ParallelLayout

    layout = ParallelLayout(context_parallel_size=world)
    backend = CPUBackend()
    backend.install_communicators(build_communicators(layout, rank, backend))
    comm = build_cp_communicator(layout, rank, backend)
    out = {}
    for key, path in paths.items():
        model = load_model(path, backend, torch.float32, progress=False)
        cpf = ContextParallelForward(model, comm, MIN_TOKENS)
        run = _drive(model, lambda batch, kv, cpf=cpf: cpf.logits_hidden(batch, kv.caches), forced[key])
        run["split_steps"] = cpf.num_split_steps
        out[key] = run
    return out


def _reference(path: str) -> dict:
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.registry import load_model

    model = load_model(path, CPUBackend(), torch.float32, progress=False)
    return _drive(model, lambda batch, kv: model.forward(batch, kv.caches)[batch.logits_indices])


@pytest.fixture(scope="module")
def model_reference(checkpoint) -> tuple[dict, dict]:
    """(preset -> checkpoint path, preset -> the one-process run), made once for both world sizes."""
    paths = {p: checkpoint(p) for p in MODEL_PRESETS}
    return paths, {k: _reference(p) for k, p in paths.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_model_equals_one_process(model_reference, world):
    """cp=2 and cp=4, V2-Lite and V3: logits of every token within fp32 rounding of one process, greedy tokens
    equal, the two prefill steps split (the decodes not), ranks bit-identical in logits and KV caches."""
    from deepinfer.parallel.local_ranks import run_local_ranks

    paths, ref = model_reference
    runs = run_local_ranks(_cp_rank, world, paths, {k: r["fed"] for k, r in ref.items()}, timeout_s=300)
    for key in paths:
        r = ref[key]
        for rank in range(world):
            got = runs[rank][key]
            assert got["split_steps"] == SPLIT_STEPS, f"{key} rank {rank}: {got['split_steps']} split steps"
            for step, (a, b) in enumerate(zip(got["logits"], r["logits"])):
                where = f"{key} rank {rank} step {step}"
                assert a.shape == b.shape, where
                torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, w=where: f"{w}: {m}")
            assert got["argmax"] == r["argmax"], f"{key} rank {rank}: greedy tokens differ"
            for layer, (mine, theirs) in enumerate(zip(got["entries"], r["entries"])):
                for sid, (a, b) in enumerate(zip(mine, theirs)):
                    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, w=(key, layer, sid):
                                               f"KV entries {w}: {m}")
        for rank in range(1, world):  # every cp rank holds the same bits: logits and the whole KV cache
            for step in range(len(SCHEDULE)):
                assert torch.equal(runs[rank][key]["logits"][step], runs[0][key]["logits"][step]), (key, rank, step)
            for a_layer, b_layer in zip(runs[rank][key]["entries"], runs[0][key]["entries"]):
                assert all(torch.equal(a, b) for a, b in zip(a_layer, b_layer)), (key, rank)


# ---------------------------------------------------------------- the engine on cp ranks

ENGINE_PROMPTS = [PROMPTS[0][:200], PROMPTS[1][:30]]
# the second round shares 160 tokens (10 full blocks) of the first prompt: a prefix-cache hit, then a split
# prefill of the rest on top of the cached context
ENGINE_PROMPTS_2 = [PROMPTS[0][:160] + PROMPTS[1][:37], PROMPTS[1][:30]]
ENGINE_SETTINGS = {"device": "cpu", "load_progress": False, "max_model_len": 512, "max_num_batched_tokens": 96,
                   "enable_chunked_prefill": True, "enable_prefix_caching": True, "dist_timeout_s": 60.0}


def _engine_run(path: str, settings: dict) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(path, **ENGINE_SETTINGS, **settings)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=1234)
    out = {"first": [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS, greedy, use_tqdm=False)]}
    second = llm.generate(ENGINE_PROMPTS_2, greedy, use_tqdm=False)
    out["second"] = [o.outputs[0].token_ids for o in second]
    out["cached"] = [o.num_cached_tokens for o in second]
    out["seeded"] = [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS_2, seeded, use_tqdm=False)]
    cpf = llm.runner.context_parallel
    out["split_steps"] = 0 if cpf is None else cpf.num_split_steps
    llm.shutdown()
    return out


def test_context_parallel_engine_equals_one_process(checkpoint):
    """The engine at context_parallel_size=2 (the leader spawns the other rank), chunked prefill (96-token budget)
    and prefix caching on: greedy and seeded tokens equal the one-process engine's; long prefill chunks were
    split, the second round hit the prefix cache."""
    path = checkpoint("tiny-v2-lite")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, __file__, "engine", path,
                             json.dumps({"context_parallel_size": 2, "cp_min_prefill_tokens": 32})],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ref = _engine_run(path, {})  # in this process meanwhile: one process, no cp
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{out[-3000:]}\n{err[-6000:]}"
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["first"] == ref["first"]
    assert got["second"] == ref["second"]
    assert got["seeded"] == ref["seeded"]
    assert got["cached"] == ref["cached"] and got["cached"][0] >= 160
    assert got["split_steps"] >= 4 and ref["split_steps"] == 0  # 200 tokens in 96-token chunks, and the rest


# ---------------------------------------------------------------- start-up refusals (no processes)


def _refusal(checkpoint, hf_changes: dict | None = None, backend=None, **settings) -> str:
    """The ConfigError join_parallel_job raises before any process starts."""
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.config import EngineConfig
    from deepinfer.engine.parallel_setup import join_parallel_job
    from deepinfer.errors import ConfigError
    from deepinfer.models.registry import load_hf_config

    path = checkpoint("tiny-v2-lite")
    hf = {**load_hf_config(path), **(hf_changes or {})}
    cfg = EngineConfig(path, context_parallel_size=2, **settings)
    with pytest.raises(ConfigError) as e:
        join_parallel_job(cfg, backend or CPUBackend(), hf)
    return str(e.value)


def test_context_parallel_refuses_tensor_parallel(checkpoint):
    msg = _refusal(checkpoint, tensor_parallel_size=2)
    assert "context_parallel_size=2 with EngineConfig.tensor_parallel_size=2" in msg


def test_context_parallel_refuses_data_parallel_and_expert_parallel(checkpoint):
    assert "with EngineConfig.data_parallel_size=2" in _refusal(checkpoint, data_parallel_size=2)
    assert "with EngineConfig.enable_expert_parallel" in _refusal(checkpoint, enable_expert_parallel=True)


def test_context_parallel_refuses_speculation(checkpoint):
    msg = _refusal(checkpoint, speculative_method="ngram")
    assert "context_parallel_size=2 with speculative decoding" in msg


def test_context_parallel_refuses_other_models_and_fp8_kv(checkpoint):
    """V4 splits too (test_context_parallel_v4.py); a model type whose attention takes no split step is refused."""
    assert "model_type 'llama'" in _refusal(checkpoint, {"model_type": "llama"})
    assert "kv_cache_dtype='fp8'" in _refusal(checkpoint, kv_cache_dtype="fp8")


def test_context_parallel_refuses_one_rank_backends():
    """nvidia and ascend declare one rank (max_tensor_parallel_size 1): refused with the cp reason, and by
    the caps check the engine runs first."""
    from deepinfer.backend import FeatureRequest
    from deepinfer.backends.ascend.caps import ascend_caps
    from deepinfer.config import EngineConfig
    from deepinfer.parallel.cp_forward import context_parallel_refusals

    cfg = EngineConfig(context_parallel_size=2)
    caps = ascend_caps("a2", on_cpu=True)
    assert any("needs 2 ranks; this backend allows 1" in r
               for r in context_parallel_refusals(cfg, {"model_type": "deepseek_v3"}, caps))
    assert caps.unsupported(FeatureRequest(tensor_parallel_size=cfg.parallel_layout().world_size))
    assert context_parallel_refusals(EngineConfig(), {"model_type": "deepseek_v4"}, caps) == []  # cp=1: nothing


def test_context_parallel_flags_are_validated_and_named():
    from deepinfer.config import EngineConfig
    from deepinfer.errors import ConfigError

    with pytest.raises(ConfigError, match="EngineConfig.context_parallel_size must be an integer >= 1"):
        EngineConfig(context_parallel_size=0)
    with pytest.raises(ConfigError, match="EngineConfig.cp_min_prefill_tokens must be an integer >= 1"):
        EngineConfig(cp_min_prefill_tokens=0)
    layout = EngineConfig(context_parallel_size=4).parallel_layout()
    assert layout.world_size == 4 and layout.all_cp_groups() == [[0, 1, 2, 3]]
    assert [layout.coords(r).cp_rank for r in range(4)] == [0, 1, 2, 3]
    assert {layout.coords(r).dp_rank for r in range(4)} == {0} and {layout.coords(r).tp_rank for r in range(4)} == {0}


if __name__ == "__main__":
    mode, ckpt, settings_json = sys.argv[1:4]
    if mode != "engine":
        raise SystemExit(f"unknown mode {mode!r} (engine)")
    print("RESULT " + json.dumps(_engine_run(ckpt, json.loads(settings_json))), flush=True)
