"""Context-parallel prefill of DeepSeek-V4 (models/deepseek_v4/cp_attention.py) on gloo ranks, against one process.

The tiny-v4 preset (sliding window W=8, CSA m=4 with the lightning indexer, HCA m=16, a hash-routed MoE layer,
hyper-connections), driven by hand over tests/v4's paged hybrid cache (block size 4): a 150-token prompt
prefilled in two chunks (90, then 60 on top of the cached 90: the second chunk starts mid-window for W, m and
16 = one compressed block of CSA entries), beside a 37-token and a 3-token prompt, then decode steps. Every
rank must give logits within fp32 rounding of one process for every token and the same argmax; both prefill
steps split (the decodes run whole); every rank's caches (sliding-window keys, compressed entries, indexer
keys, compressor rings) must match one process and be bit-identical across the ranks.

Run as a script (`python test_context_parallel_v4.py engine CKPT JSON`) it builds a parallel engine in its own
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "v4"))
from v4_helpers import PagedRunner

ATOL, RTOL = 2e-5, 1e-5
_rng = random.Random(4)
PROMPTS = [[_rng.randrange(2, 1024) for _ in range(n)] for n in (150, 37, 3)]
# per step, per sequence: (start, end) of its prompt to prefill, or None for a decode of the last greedy token
SCHEDULE = [[(0, 90), (0, 37), (0, 3)], [(90, 150), None, None], [None, None, None], [None, None, None]]
SPLIT_STEPS = 2  # steps 0 and 1 carry >= MIN_TOKENS prefill tokens; the decode steps run whole
MIN_TOKENS = 32


class _Split:
    """What PagedRunner drives: the model's cache specs and logits, its forward through ContextParallelForward
    (PagedRunner asks for every row's logits, so logits_hidden returns every row in step order)."""

    def __init__(self, model, cpf):
        self.model, self.cpf = model, cpf

    def kv_cache_specs(self):
        return self.model.kv_cache_specs()

    def __call__(self, batch, caches):
        return self.cpf.logits_hidden(batch, caches)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def _drive(model, forced: list[list[int]] | None = None) -> dict:
    """Run SCHEDULE (decode tokens: `forced`, else the greedy argmax). Returns every step's logits (every
    token), the greedy token of each sequence per step, the tokens fed, and every cache and state tensor."""
    runner = PagedRunner(model)
    for rid in range(len(PROMPTS)):
        runner.add(rid)
    logits, argmax, fed = [], [], []
    last: list[int] = []
    for step, plan in enumerate(SCHEDULE):
        chunks = [(i, PROMPTS[i][p[0]:p[1]] if p is not None else [forced[step][i] if forced else last[i]])
                  for i, p in enumerate(plan)]
        fed.append([t[-1] for _, t in chunks])
        lg = runner.step(chunks).float()
        logits.append(lg)
        ends = torch.tensor([len(t) for _, t in chunks]).cumsum(0) - 1
        last = lg[ends].argmax(-1).tolist()
        argmax.append(last)
    caches = {f"{g}/{layer}": t.clone() for (g, layer), t in runner.caches.kv.items()}
    caches.update({f"{g}/{layer}/state": t.clone() for (g, layer), t in runner.caches.state.items()})
    return {"logits": logits, "argmax": argmax, "fed": fed, "caches": caches}


def _cp_rank(rank: int, world: int, path: str, forced: list[list[int]]) -> dict:
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.registry import load_model
    from deepinfer.parallel.cp_forward import ContextParallelForward
    from deepinfer.parallel.groups import build_communicators, build_cp_communicator
    from deepinfer.parallel.layout import ParallelLayout

    layout = ParallelLayout(context_parallel_size=world)
    backend = CPUBackend()
    backend.install_communicators(build_communicators(layout, rank, backend))
    model = load_model(path, backend, torch.float32, progress=False)
    cpf = ContextParallelForward(model, build_cp_communicator(layout, rank, backend), MIN_TOKENS)
    with torch.no_grad():
        run = _drive(_Split(model, cpf), forced)
    run["split_steps"] = cpf.num_split_steps
    return run


@pytest.fixture(scope="module")
def v4_reference(checkpoint) -> tuple[str, dict]:
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.registry import load_model

    path = checkpoint("tiny-v4")
    with torch.no_grad():
        return path, _drive(load_model(path, CPUBackend(), torch.float32, progress=False))


@pytest.mark.parametrize("world", [2, 4])
def test_v4_context_parallel_model_equals_one_process(v4_reference, world):
    """cp=2 and cp=4 (at 4 the 37-token prompt splits too): logits within fp32 rounding of one process, the
    same greedy tokens, both prefill steps split, caches and rings as one process and bit-identical on every
    rank."""
    from deepinfer.parallel.local_ranks import run_local_ranks

    path, ref = v4_reference
    runs = run_local_ranks(_cp_rank, world, path, ref["fed"], timeout_s=300)
    for rank, got in enumerate(runs):
        assert got["split_steps"] == SPLIT_STEPS, f"rank {rank}: {got['split_steps']} split steps"
        for step, (a, b) in enumerate(zip(got["logits"], ref["logits"])):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, w=(rank, step): f"{w}: {m}")
        assert got["argmax"] == ref["argmax"], f"rank {rank}: greedy tokens differ"
        assert set(got["caches"]) == set(ref["caches"])
        for name, t in got["caches"].items():
            torch.testing.assert_close(t, ref["caches"][name], atol=ATOL, rtol=RTOL,
                                       msg=lambda m, w=(rank, name): f"cache {w}: {m}")
    for rank in range(1, world):  # every cp rank holds the same bits: logits and every cache and ring
        for step in range(len(SCHEDULE)):
            assert torch.equal(runs[rank]["logits"][step], runs[0]["logits"][step]), (rank, step)
        for name, t in runs[rank]["caches"].items():
            assert torch.equal(t, runs[0]["caches"][name]), (rank, name)


def test_v4_context_parallel_refuses_a_backend_v4_op(checkpoint):
    """The split replays the native op's cache layout: a backend whose V4 op is its own is refused when the
    ContextParallelForward is built (engine start-up), naming the op."""
    from deepinfer.backend import SingleProcessCommunicator, V4AttentionOp
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.config import EngineConfig
    from deepinfer.errors import ConfigError
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from deepinfer.models.registry import load_hf_config
    from deepinfer.parallel.cp_forward import ContextParallelForward, context_parallel_refusals

    class VendorV4Op(V4AttentionOp):  # a stand-in for a vendor's fused layer: never run here
        def load_weights(self, weights):
            raise NotImplementedError

        def forward(self, *args, **kwargs):
            raise NotImplementedError

    class VendorBackend(CPUBackend):
        def make_v4_attention(self, spec):
            return VendorV4Op(spec)

    hf = load_hf_config(checkpoint("tiny-v4"))
    assert context_parallel_refusals(EngineConfig(context_parallel_size=2), hf) == []  # V4 is no longer refused
    native = DeepseekV4ForCausalLM(hf, CPUBackend(), torch.float32)
    assert native.context_parallel_reasons() == []
    vendor = DeepseekV4ForCausalLM(hf, VendorBackend(), torch.float32)
    with pytest.raises(ConfigError, match="V4 attention op \\(VendorV4Op\\) owns its own layout"):
        ContextParallelForward(vendor, SingleProcessCommunicator(), MIN_TOKENS)


# ---------------------------------------------------------------- the engine on cp ranks

ENGINE_PROMPTS = [PROMPTS[0][:120], PROMPTS[1][:30]]
# the second round shares 96 tokens (6 full blocks) of the first prompt: a prefix-cache hit (rings and partial
# compressed blocks restored from the snapshots the split steps took), then a split prefill of the rest
ENGINE_PROMPTS_2 = [PROMPTS[0][:96] + PROMPTS[1][:37], PROMPTS[1][:30]]
ENGINE_SETTINGS = {"device": "cpu", "load_progress": False, "max_model_len": 256, "max_num_batched_tokens": 64,
                   "enable_chunked_prefill": True, "enable_prefix_caching": True, "dist_timeout_s": 60.0}


def _engine_run(path: str, settings: dict) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(path, **ENGINE_SETTINGS, **settings)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=5, temperature=0.9, seed=1234, ignore_eos=True)
    out = {"first": [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS, greedy, use_tqdm=False)]}
    second = llm.generate(ENGINE_PROMPTS_2, greedy, use_tqdm=False)
    out["second"] = [o.outputs[0].token_ids for o in second]
    out["cached"] = [o.num_cached_tokens for o in second]
    out["seeded"] = [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS_2, seeded, use_tqdm=False)]
    cpf = llm.runner.context_parallel
    out["split_steps"] = 0 if cpf is None else cpf.num_split_steps
    llm.shutdown()
    return out


def test_v4_context_parallel_engine_equals_one_process(checkpoint):
    """tiny-v4 through the engine at context_parallel_size=2 (the leader spawns the other rank), chunked prefill
    (64-token budget) and prefix caching on: greedy and seeded tokens equal the one-process engine's; long prefill
    chunks were split; the second round hit the prefix cache."""
    path = checkpoint("tiny-v4")
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
    assert got["cached"] == ref["cached"] and got["cached"][0] >= 96
    assert got["split_steps"] >= 3 and ref["split_steps"] == 0


if __name__ == "__main__":
    mode, ckpt, settings_json = sys.argv[1:4]
    if mode != "engine":
        raise SystemExit(f"unknown mode {mode!r} (engine)")
    print("RESULT " + json.dumps(_engine_run(ckpt, json.loads(settings_json))), flush=True)
