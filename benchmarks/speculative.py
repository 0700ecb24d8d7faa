"""Speculative decoding on the embedded stdlib-coder model: per-user and total tok/s, speculation off vs static
draft lengths vs the confidence scheduler, at several concurrencies (issue 17's benchmark, CPU part).

    python -m benchmarks.speculative                       # concurrency 1 4 16 64, off / k=1,3,5 / adaptive
    python -m benchmarks.speculative --concurrency 1 4 --max-tokens 32
    python -m benchmarks.speculative --model /tmp/stdlib-coder-v4    # another checkpoint with an MTP module
    python -m benchmarks.speculative --device cuda --model /tmp/ckpt-v2-lite-mtp-bench --kv-cache-gib 2
        # V2-Lite layer shapes, drafts accepted at a set rate (deepinfer/checkpoints/presets_mtp_bench.py)

Each (mode, concurrency) cell submits `concurrency` greedy code prompts at once (ignore_eos, max_tokens
fixed, so every mode does the same work and emits the same tokens: the benchmark checks they are equal to
the off run's) and measures per-user tok/s (the mean over requests of output tokens / time from submission
to the request's last token) and total tok/s (all output tokens / wall time). The modes run one after the
other per concurrency, in alternating order over `--repeats`, and the best repeat is kept (the machine's
other load only slows a run down); `paired` is the median over repeats of each repeat's total tok/s over off's in
that repeat (`paired_ratio`). One JSON line per cell, then a table. Results go to docs/speculative.md
with date, machine and command. On a GPU every Triton kernel compiled (or loaded from the disk cache) inside a
timed cell is printed (`compiles at ...`, benchmarks/triton_compiles.py) and counted in the cell's JSON
(`triton_compiles`, `triton_compile_s`): a 0.7-1.2 s catch-up step at 256 sequences (sessions 20 and 25) was
suspected to be one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import torch

from deepinfer.spec.step_phases import StepPhases
from deepinfer.spec.step_times import load_bucket

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv):\n    parser = ",
    "def merge_sort(items):\n",
    "import json\n\n\ndef load_config(path):\n",
    "class Node:\n    def __init__(self, value, next=None):\n",
    "def read_lines(filename):\n    with open(",
]

MODES = {
    "off": {},
    "k1": dict(speculative_method="mtp", num_speculative_tokens=1),
    "k3": dict(speculative_method="mtp", num_speculative_tokens=3),
    "k5": dict(speculative_method="mtp", num_speculative_tokens=5),
    "adaptive": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    "ngram3": dict(speculative_method="ngram", num_speculative_tokens=3),
    # adaptive with its pause steps sync (as before spec/async_pauses.py), for an A/B in one process
    "adaptive_sync": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive with session 15's policy (any loss pauses; every slot priced), for an A/B in one process
    "adaptive_s15": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive without session 30's time fit (spec/chain_plan.py `_fitted_rates`), for an A/B in one process
    "adaptive_nofit": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive without challenges (spec/chain_challenge.py: challenge_every 0), for an A/B in one process
    "adaptive_nochal": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # static k with async scheduling: steps chained on the device results of the one in flight (spec/chained_steps.py)
    "k3_async": dict(speculative_method="mtp", num_speculative_tokens=3, async_scheduling=True),
    "k5_async": dict(speculative_method="mtp", num_speculative_tokens=5, async_scheduling=True),
    "adaptive_async": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True,
                           async_scheduling=True),
    # static k = 5 with each step's read-back waited for in its own call (DEEPINFER_SPEC_OVERLAP_OUTPUT=0), the A/B
    # of overlapped output (spec/overlap.py)
    "k5_nooverlap": dict(speculative_method="mtp", num_speculative_tokens=5),
    # adaptive without measuring plans (SlotPolicy.measure_steps 0: a new load is priced from the start-up tables
    # and the realized rates alone), for an A/B in one process
    "adaptive_nomeasure": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive observing every step, settled or not (SlotPolicy.observe_every 1, as before session 38:
    # spec/settled_steps.py), for an A/B in one process
    "adaptive_allobs": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive with the time fit ordering the chains (SlotPolicy.fit_orders), for an A/B in one process
    "adaptive_fitorder": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive with each chain's rate from its own steps' tokens (RealizedRates.paired False, as before session 39),
    # for an A/B in one process
    "adaptive_unpaired": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive with the plan's model taking its tokens from paired counts (SlotPolicy.paired_model "current" /
    # "longest"), for an A/B in one process
    "adaptive_pcur": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    "adaptive_plong": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive without measuring a load visited afresh (SlotPolicy.measure_visits False), for an A/B in one process
    "adaptive_novisit": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive whose observations never wait while it holds (SlotPolicy.max_waiting_observations 0), for an A/B
    "adaptive_nowait": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive whose plans do not hold through a fall in load (SlotPolicy.hold_falls False), for an A/B
    "adaptive_nofall": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # challenges of shorter chains out of reach made anyway (SlotPolicy.bound_challenges off, as before session 41)
    "adaptive_nobound": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
}
# environment a mode's engine is built under (read at start-up)
MODE_ENV = {"adaptive_sync": {"DEEPINFER_SPEC_ASYNC_PAUSES": "0"}, "k5_nooverlap": {"DEEPINFER_SPEC_OVERLAP_OUTPUT": "0"}}
# SlotPolicy fields set on a mode's engine once built
MODE_POLICY = {"adaptive_s15": {"pause_margin": 0.0, "admit_all_below": 0.0}, "adaptive_nofit": {"time_fit": False},
               "adaptive_nochal": {"challenge_every": 0}, "adaptive_nomeasure": {"measure_steps": 0},
               "adaptive_allobs": {"observe_every": 1}, "adaptive_fitorder": {"fit_orders": True},
               "adaptive_unpaired": {"realized.paired": False}, "adaptive_pcur": {"paired_model": "current"},
               "adaptive_plong": {"paired_model": "longest"}, "adaptive_novisit": {"measure_visits": False},
               "adaptive_nowait": {"max_waiting_observations": 0}, "adaptive_nofall": {"hold_falls": False},
               "adaptive_nobound": {"bound_challenges": False}}
DEFAULT_MODES = [m for m in MODES if m not in ("adaptive_sync", "adaptive_s15", "adaptive_nofit", "adaptive_nochal",
                                              "adaptive_nomeasure", "adaptive_allobs", "adaptive_fitorder",
                                              "adaptive_unpaired", "adaptive_pcur", "adaptive_plong",
                                              "adaptive_novisit", "adaptive_nowait", "adaptive_nofall", "adaptive_nobound",
                                              "k3_async", "k5_async", "adaptive_async", "k5_nooverlap")]


def warm_long_prompts(engine, concurrency: int) -> None:
    """Prompts of ~3/4 max_model_len at the sweep's largest concurrency, two tokens each: the prefill-sized kernels
    (the main model's chunks and the MTP module's passes over them, which a pause's catch-up reuses) compile here.
    An engine given its KV cache size (--kv-cache-gib) runs no profiling forward of its token budget at start-up,
    which otherwise compiles some of them (on an H100, session 43, three Triton kernels compiled inside a timed cell
    at 64 sequences without it: 0.94 s; the profiling forward, prompts of token id 0, does not cover every shape
    either: session 42's run compiled two inside a cell at 64 sequences with it). Only with
    --kv-cache-gib, so the embedded model's runs keep the warm-up they were measured with."""
    from deepinfer import SamplingParams

    tok = engine.tokenizer
    ids = tok.encode("".join(PROMPTS))
    want = 3 * engine.config.max_model_len // 4
    prompt = tok.decode((ids * (want // max(len(ids), 1) + 1))[:want])
    engine.generate([prompt] * concurrency, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                    use_tqdm=False)


def run_cell(engine, concurrency: int, max_tokens: int) -> tuple[dict, list[list[int]]]:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
    policy = getattr(getattr(engine, "_spec", None), "policy", None)
    d0 = dict(policy.decisions) if policy is not None else {}
    s0 = engine.stats()
    t0 = time.monotonic()
    outs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.monotonic() - t0
    s1 = engine.stats()
    # the adaptive plan's decisions in this cell (SlotPolicy.decisions: steps by chain, pause, probe, measure, ...)
    plan = {k: v - d0.get(k, 0) for k, v in (policy.decisions if policy is not None else {}).items()
            if v != d0.get(k, 0)}
    acc = s1.spec_accepted_tokens - s0.spec_accepted_tokens
    drafted = s1.spec_drafted_tokens - s0.spec_drafted_tokens
    steps = s1.spec_request_steps - s0.spec_request_steps
    spec = {"tau": 1 + acc / steps if steps else float("nan"),
            "acceptance": acc / drafted if drafted else float("nan"),
            "verified_per_step": drafted / max(1, s1.spec_steps - s0.spec_steps),
            "async_steps": s1.spec_async_steps - s0.spec_async_steps}
    tokens = [len(o.outputs[0].token_ids) for o in outs]
    per_user = [n / (o.metrics["finished_time"] - o.metrics["arrival_time"]) for n, o in zip(tokens, outs)]
    return {"total_tok_s": sum(tokens) / wall, "per_user_tok_s": sum(per_user) / len(per_user), "wall_s": wall,
            "tokens": sum(tokens), **spec, **({"plan": plan} if plan else {}),
            **(_plan_state(policy, concurrency) if plan and policy.cost is not None and policy.draft_cost is not None
               else {})}, [o.outputs[0].token_ids for o in outs]


class PlanTrace:
    """--plan-trace: each adaptive engine's plan decisions and observed steady steps, one JSON line per mode and
    cell, so that a GPU run shows when and on what measures the plan chose each chain (the plan-state lines give
    only a cell's end)."""

    def __init__(self, path: str, engines: dict):
        self.path, self.policies = path, {}
        for mode, engine in engines.items():
            policy = getattr(getattr(engine, "_spec", None), "policy", None)
            if policy is not None and policy.adaptive:
                policy.plan_trace, policy.realized.trace = [], []
                self.policies[mode] = policy
        open(path, "w").close()

    def dump(self, mode: str, concurrency: int, repeat: int) -> None:
        policy = self.policies.get(mode)
        if policy is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"mode": mode, "concurrency": concurrency, "repeat": repeat,
                                "plans": policy.plan_trace, "steps": policy.realized.trace}) + "\n")
        policy.plan_trace, policy.realized.trace = [], []


def _plan_state(policy, load: int) -> dict:
    """What the adaptive plan saw at the cell's load when the cell ended: the model's gain of each chain over plain
    decoding (`chain_rates`), the realized rates and steps of each chain measured at that load, and the speculative
    and plain step-time corrections of its bucket (spec/step_times.py): why it drafted the chains it did."""
    tokens, seconds = policy.chain_model(load)
    rates = [t / s for t, s in zip(tokens, seconds)]
    realized = {f"{c}": [round(r), n] for b, c, r, n in policy.realized.rows() if b == load}
    paired = {f"{c}": round(r) for c, r in policy.realized.paired_rows(load)}
    times = {f"{k}": [round(r, 3), round(a * 1e3, 3), n] for k, b, r, a, n in policy.step_times.rows()
             if b == load_bucket(load)}
    return {"model_gains": [round(r / rates[0], 3) for r in rates], "realized_at_load": realized,
            "priced_at_load": paired,  # (the rates the plan compares: RealizedRates._rate_at, paired tokens)
            "step_times_at_load": times,
            # which side of a modelled gain is off where it misses the realized one: its tokens a step (from the
            # calibrated survival) or its step time (tables and step-time corrections)
            "model_tokens_per_step": [round(t, 1) for t in tokens],
            "model_step_ms": [round(s * 1e3, 3) for s in seconds]}


def print_drafting(mode: str, engine) -> None:
    """How the MTP drafter ran (graph replays vs eager), and for adaptive its cost tables and measured step-time
    ratios: what the confidence scheduler priced drafting at (spec/draft_cost.py, spec/slot_policy.py)."""
    spec = getattr(engine, "_spec", None)
    drafter = getattr(spec, "drafter", None)
    if drafter is None or not hasattr(drafter, "num_graph_passes"):
        return
    print(f"{mode}, MTP drafter: passes {drafter.num_graph_passes} replayed / {drafter.num_eager_passes} eager, "
          f"chains replayed in {drafter.num_graph_chains} steps, {drafter.num_eager_chain_seqs} sequence chains eager"
          + ("" if drafter.graphs is not None else " (no MTP graphs)"))
    policy = spec.policy
    if spec.overlap:
        print(f"{mode}, steps resolved by the next call (spec/overlap.py): {spec.num_overlapped_steps}; chained on the "
              f"device results of the one in flight (spec/chained_steps.py): {spec.num_chained_steps}"
              + (f", not chained: {dict(sorted(spec.chain_fallbacks.items()))}" if spec.chaining else ""))
    pauses = spec.async_pauses
    if pauses is not None:
        print(f"{mode}, pause steps: {pauses.num_steps} async (spec/async_pauses.py), kept sync: "
              + ", ".join(f"{why} {n}" for why, n in pauses.sync_steps.items())
              + f"; {pauses.num_drains} drains, {pauses.inner.num_sync_fallbacks} async fallbacks")
    elif policy.adaptive:
        print(f"{mode}, pause steps: all sync")
    if policy.adaptive:
        print(f"{mode}, pauses ended by a fall in load: {policy.num_load_ends}; admissions that verified every held "
              f"slot as nearly free (SlotPolicy.admit_all_below): {policy.num_admitted_all}, held unpriced after a streak "
              f"of such (SlotPolicy.hold_after): {policy.num_admission_holds}; challenges (spec/chain_challenge.py): "
              f"{policy.num_challenges}, {policy.num_challenges_won} of them changing the plan's chain, "
              f"{policy.num_challenges_bounded} shorter challengers out of reach; settled steps "
              f"unobserved (spec/settled_steps.py): {policy.num_unobserved}; output processing per "
              "token by load bucket: " + ", ".join(f"<={b} {x * 1e6:.1f} us" for b, x in sorted(policy.token_seconds.items())))
    if spec.policy_steps:
        print(f"{mode}, slot policy host time: {spec.policy_seconds / spec.policy_steps * 1e6:.0f} us a step over "
              f"{spec.policy_steps} speculative-path steps (admission, plan, calibration)")
    if policy.draft_cost is not None:
        t = policy.draft_cost
        print(f"{mode}, drafting table (chain 1 / {t.k}): " + ", ".join(
            f"{n} seqs {a * 1e3:.3f} / {b * 1e3:.3f} ms ({shape})"
            for n, a, b, shape in zip(t.counts, t.one.seconds, t.full.seconds, t.shapes)))
    if policy.cost is not None:
        print(f"{mode}, step table: " + ", ".join(f"{n} tok {x * 1e3:.3f} ms ({shape})" for n, x, shape in
                                                 zip(policy.cost.tokens, policy.cost.seconds, policy.cost_shapes)))
        if policy.adaptive and policy.draft_cost is not None:  # what the plan would choose now, by load
            seen = sorted({b for _, b, *_ in policy.step_times.rows()})
            print(f"{mode}, plan now (tok/s of plain, chains 1..{policy.k}): " + "; ".join(
                f"{b} seqs " + " / ".join(f"{r:.0f}" for r in policy.chain_rates(b)) for b in seen))
        if policy.adaptive:
            rows = [row for row in policy.realized.rows() if row[3] >= policy.realized.min_count]
            print(f"{mode}, realized tok/s of steady steps by load and chain, where trusted (spec/realized_rates.py): "
                  + (", ".join(f"{b} seqs chain {c} {r:.0f} ({n} steps)" for b, c, r, n in rows) or "none"))
        rows = policy.step_times.rows()
        print(f"{mode}, measured / table step time by kind and load bucket (spec/step_times.py): " + (", ".join(
            f"{kind} <={bucket} seqs {ratio:.2f} ({over * 1e3:+.3f} ms, {n} steps)"
            for kind, bucket, ratio, over, n in rows) if rows else "none seen"))


def compile_log():
    """benchmarks/triton_compiles.CompileLog where Triton is installed (it records nothing under the interpreter),
    else a context that yields None."""
    try:
        from triton import knobs  # noqa: F401 (the hooks CompileLog installs)

        from benchmarks.triton_compiles import CompileLog
    except ImportError:
        return contextlib.nullcontext()
    return CompileLog()


def paired_ratio(mode_totals: list[float], off_totals: list[float]) -> float:
    """The median over repeats of a mode's total tok/s over off's in the same repeat (the `paired` column). The
    repeats interleave the modes, so a repeat's cells ran close in time: on the H200 (2026-12-05, session 22) the
    off rows of one load moved by up to 43% between runs, and the best-of-repeats ratio (`vs off`) divides two
    bests that may come from different moments of the machine."""
    ratios = [m / o for m, o in zip(mode_totals, off_totals) if o > 0]
    return statistics.median(ratios) if ratios else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES),
                    help="adaptive_sync (not in the default): adaptive with DEEPINFER_SPEC_ASYNC_PAUSES=0; "
                         "adaptive_s15 (not in the default): adaptive with session 15's policy (MODE_POLICY)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engines' max_num_seqs (default: the largest --concurrency). A run at one concurrency "
                         "alone builds graphs of that many rows; a sweep's engines cover its largest, so give the "
                         "sweep's value to compare a lone concurrency with it")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (the engine shares one loaded model) or cuda")
    ap.add_argument("--model", default=None,
                    help="a checkpoint directory with an MTP module (default: the embedded stdlib-coder), e.g. the "
                         "V4 that tools/stdlib_coder/train_v4.py trains")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="each engine's KV cache (kv_cache_memory_bytes; default: the engine's own sizing). On a GPU "
                         "each mode builds its own engine: give this where several engines of a large model share it")
    ap.add_argument("--dtype", default=None, help="default: float32 on the cpu, bfloat16 on a GPU")
    ap.add_argument("--profile", nargs="*", default=[], metavar="MODE:CONC",
                    help="after the table, profile one cell of each MODE at CONC (device kernels and host Python)")
    ap.add_argument("--plan-trace", default=None, metavar="PATH",
                    help="write every adaptive plan decision (SlotPolicy.plan_trace) and observed steady step "
                         "(RealizedRates.trace) to PATH, one JSON line per mode and cell (warm-up cells: repeat -1)")
    ap.add_argument("--trace-dir", default=None, help="where --profile writes its traces (default: a temp dir)")
    ap.add_argument("--profile-lines", type=int, default=30,
                    help="host functions --profile prints by cumulative time (half as many by own time)")
    args = ap.parse_args(argv)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")

    import deepinfer
    from deepinfer import EngineConfig, envs
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.engine import DeepInferenceEngine
    from deepinfer.models.registry import load_model
    from deepinfer.text.tokenizer import Tokenizer

    path = args.model or deepinfer.embedded_model_path()
    engines = {}
    if args.device == "cpu":
        backend = CPUBackend()
        model = load_model(path, backend, getattr(torch, dtype), progress=False, load_mtp=True)
        tok = Tokenizer.from_pretrained(path)
    for mode in args.modes:
        cfg = EngineConfig(model_name_or_path=path, device=args.device, dtype=dtype, max_model_len=512,
                           max_num_seqs=args.max_num_seqs or max(args.concurrency), load_progress=False,
                           kv_cache_memory_bytes=None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30),
                           **MODES[mode])
        saved = {v.name: v.raw() for v in envs.ALL if v.name in MODE_ENV.get(mode, {})}
        os.environ.update(MODE_ENV.get(mode, {}))
        try:  # On a GPU each mode builds its own engine (its own graphs and KV pool); the cpu shares one model.
            engines[mode] = (DeepInferenceEngine.from_components(cfg, model, tok, backend) if args.device == "cpu"
                             else DeepInferenceEngine.from_config(cfg))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        for field_name, value in MODE_POLICY.get(mode, {}).items():
            owner, _, attr = field_name.rpartition(".")  # (a dotted name: a part's field, realized.paired)
            policy = engines[mode]._spec.policy
            setattr(getattr(policy, owner) if owner else policy, attr, value)
    tracer = PlanTrace(args.plan_trace, engines) if args.plan_trace else None
    for mode, engine in engines.items():  # warm-up: first-call costs (Triton compiles per shape) are not a mode's
        if args.kv_cache_gib is not None:
            warm_long_prompts(engine, max(args.concurrency))
        for c in args.concurrency:
            run_cell(engine, c, 16)
            if tracer is not None:
                tracer.dump(mode, c, -1)
    results = []
    for c in args.concurrency:
        best: dict[str, dict] = {}
        seen: dict[str, list[float]] = {}  # every repeat's per-user tok/s: the spread the best one hides
        totals: dict[str, list[float]] = {}  # every repeat's total tok/s (the paired ratio over off's)
        plans: dict[str, list[dict]] = {}  # every repeat's adaptive plan decisions (run_cell's "plan")
        phases: dict[str, StepPhases] = {}  # the spec path's steps over every repeat (spec/step_phases.py)
        compiles: dict[str, list] = {}  # Triton compiles inside the timed cells, every repeat
        ref = None
        for r in range(args.repeats):
            order = args.modes if r % 2 == 0 else args.modes[::-1]
            for mode in order:
                spec = getattr(engines[mode], "_spec", None)
                before = spec.phases.snapshot() if spec is not None else None
                with compile_log() as log:  # Triton kernels compiled inside a timed cell (benchmarks/triton_compiles.py)
                    cell, toks = run_cell(engines[mode], c, args.max_tokens)
                if log is not None and log.compiles:
                    compiles.setdefault(mode, []).extend(log.compiles)
                    print(f"compiles at {c}, {mode}, repeat {r}: {log.describe()}", flush=True)
                if tracer is not None:
                    tracer.dump(mode, c, r)
                if spec is not None:
                    phases[mode] = spec.phases.since(before).plus(phases.get(mode))
                if mode == "off":
                    ref = toks
                elif ref is not None and toks != ref:
                    if dtype == "float32":
                        raise SystemExit(f"mode {mode} at concurrency {c} changed the greedy output")
                    # bf16: a verify forward rounds differently from a decode step, so greedy paths may part
                    # after a near-tie; say how much of the output still matches rather than hide it.
                    same = sum(a == b for x, y in zip(toks, ref) for a, b in zip(x, y))
                    print(f"note: {mode} at concurrency {c}: {same}/{sum(map(len, ref))} tokens equal the "
                          f"off run's ({dtype})", flush=True)
                seen.setdefault(mode, []).append(cell["per_user_tok_s"])
                totals.setdefault(mode, []).append(cell["total_tok_s"])
                if "plan" in cell:
                    plans.setdefault(mode, []).append(cell["plan"])
                if "model_gains" in cell:
                    print(f"plan state at {c}, {mode}, repeat {r}: decisions {cell['plan']}, model gains "
                          f"{cell['model_gains']}, realized (chain: tok/s, steps) {cell['realized_at_load']}, step "
                          f"times (kind: ratio, excess ms, steps) {cell['step_times_at_load']}, model tokens a step "
                          f"{cell['model_tokens_per_step']}, model step ms {cell['model_step_ms']}", flush=True)
                if mode not in best or cell["total_tok_s"] > best[mode]["total_tok_s"]:
                    best[mode] = cell
        for mode in args.modes:
            row = {"concurrency": c, "mode": mode,
                   **{k: round(v, 3) if isinstance(v, float) else v for k, v in best[mode].items()},
                   "per_user_repeats": [round(v, 1) for v in seen[mode]],
                   **({"paired_vs_off": round(paired_ratio(totals[mode], totals["off"]), 3)}
                      if "off" in totals else {}),
                   **({"plan_repeats": plans[mode]} if mode in plans else {}),
                   "triton_compiles": len(compiles.get(mode, [])),
                   "triton_compile_s": round(sum(x.seconds for x in compiles.get(mode, [])), 3),
                   **({"phases_ms": {kind: {k: round(v, 4) for k, v in r.items()}
                                     for kind, r in phases[mode].per_step_ms().items()}} if mode in phases else {})}
            results.append(row)
            print(json.dumps(row), flush=True)
        for mode in args.modes:  # where the spec path's steps went, every repeat of the cell together
            if mode in phases:
                print(f"steps at {c}, {mode}: {phases[mode].describe()}", flush=True)
    print(f"\n{'conc':>5} {'mode':>9} {'per-user tok/s':>15} {'total tok/s':>12} {'vs off':>7} {'paired':>7} "
          f"{'tau':>5} {'accept':>6} {'verified/step':>13} {'per-user, every repeat':>24}  (machine: "
          f"{os.cpu_count()} cpus, torch {torch.__version__}, {torch.get_num_threads()} threads)")
    for row in results:
        base = next(x for x in results if x["concurrency"] == row["concurrency"] and x["mode"] == "off") \
            if "off" in args.modes else row
        print(f"{row['concurrency']:>5} {row['mode']:>9} {row['per_user_tok_s']:>15.1f} {row['total_tok_s']:>12.1f} "
              f"{row['total_tok_s'] / base['total_tok_s']:>6.2f}x {row.get('paired_vs_off', float('nan')):>6.2f}x "
              f"{row['tau']:>5.2f} {row['acceptance']:>6.3f} "
              f"{row['verified_per_step']:>13.2f} {' / '.join(f'{v:.0f}' for v in row['per_user_repeats']):>24}")
    for mode in args.modes:
        st = engines[mode].stats()
        if st.spec_method:
            print(f"{mode}, over the whole run: tau {st.spec_tau:.2f}, acceptance {st.spec_acceptance_rate:.3f}, "
                  f"mean chain (last 1024 drafting steps) {st.spec_mean_chain:.2f}, "
                  "per-slot conditional acceptance "
                  + ", ".join(f"{a:.2f}" for a in st.spec_conditional_acceptance))
            print_drafting(mode, engines[mode])
    for spec in args.profile:
        mode, _, conc = spec.partition(":")
        if mode not in engines:
            raise SystemExit(f"--profile {spec}: mode {mode!r} was not among --modes")
        from benchmarks.profile_region import profile_region

        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
        trace = os.path.join(args.trace_dir or tempfile.gettempdir(), f"spec_{mode}_c{conc}.json")
        profile_region(f"{mode} at concurrency {conc}, {args.max_tokens} tokens",
                       lambda: run_cell(engines[mode], int(conc or 1), args.max_tokens), trace,
                       host_lines=args.profile_lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
