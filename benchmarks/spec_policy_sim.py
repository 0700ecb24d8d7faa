"""The confidence scheduler in closed loop against a modelled device: the real SlotPolicy and SurvivalCalibrator
(spec/slot_policy.py, spec/confidence.py), driven in the order SpecStepPipeline calls them, with step times from a
model fitted to H200 measurements instead of a GPU. What it answers: given a device's cost structure, does the
adaptive mode find the chain that pays, and how close does it get to the best static k?

It is a model, not the engine: the pipeline's order (admission, plan before the forward while drafting steadily,
else after the draw; the draw; transition steps not observed; a catch-up step after a pause) is re-stated here, and
the device's step time is `table + drafting + h0 + h_tok * tokens emitted`, plus `host_path` seconds for a step
that verifies or drafts off the one-sync path. Per-slot acceptance rises with the draft's confidence around the
measured conditional rates.

    python -m benchmarks.spec_policy_sim [--steps 3000] [--model h200-b1 h200-b64 cpu-like]
    python -m benchmarks.spec_policy_sim --model h200-b64 --max-tokens 128 --repeats 3   # closed batches
    python -m benchmarks.spec_policy_sim --model h200-b1 h200-b4 h200-b64 --max-tokens 128 --repeats 3 \
        --warm-up 16 --host-factor 0 --seeds 12   # adaptive over the best static k, mean over seeds
"""

from __future__ import annotations

import argparse
import ast
import random
import time
from dataclasses import dataclass

from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.draft_cost import DraftCostTable
from deepinfer.spec.draft_slots import HeldDraft
from deepinfer.spec.recent_drafts import RecentDrafts
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.spec.slot_policy import SlotPolicy


@dataclass
class DeviceModel:
    """Profiled tables (what the engine prices by) and the true step time's extra terms (what it measures)."""

    seqs: int
    table: StepCostTable  # step seconds by tokens (the start-up profile)
    drafting: DraftCostTable  # drafting seconds by sequences, chains of 1 and k
    h0: float  # per-step host seconds the tables do not see
    h_tok: float  # per emitted token
    host_path: float  # a verify / draft step off the one-sync path (two waits)
    catch_up: float  # the first drafting step after a pause (its pass over the kept rows)
    accept: tuple[float, ...]  # conditional acceptance per slot at the drafts' mean confidence
    confidence: tuple[float, ...]  # the drafts' mean confidence per slot (each drawn within +-0.2 of it)
    noise: float = 0.05  # multiplicative jitter of a step
    # the true cost of a chain's links over the drafting table's (1: the table is right). On the H200 (2026-12-05,
    # session 17, 4 sequences) a one-sync step of k5 ran 0.31 ms over k3's where the table priced the two more links
    # at 0.15 ms: ~2x
    link_factor: float = 1.0
    # acceptance's slope in the draft's confidence about the slot's mean (p = accept + slope x (c - mean), clipped to
    # 0.02-0.98): 0.8 nearly linear; large, a step (drafts nearly always accepted above some confidence, mostly
    # rejected below: what makes survival at the mean confidence over-promise, spec/recent_drafts.py)
    slope: float = 0.8
    # a plain step (no draft verified or drafted) at this times the table's price: where plain decoding runs a
    # faster path than the profiled forward (the V2-Lite decode graphs, session 43)
    plain_factor: float = 1.0


def _ms(*xs: float) -> list[float]:
    return [x * 1e-3 for x in xs]


# Fitted to session 12 call 7 (2026-12-04, fd509cb; docs/perf-log/2026-12-04-session12-h200.md), embedded model:
# one sequence: plain 0.88 ms a step (table 0.321), static k5 1.82 ms (tau 5.08), probe verifications ~1.9 ms;
# 64 sequences: plain 2.29 ms, k5 6.79 ms (tau 4.11). k5's per-slot acceptance 0.82 / 0.79 / 0.88 / 0.83 / 0.88.
K5_ACCEPT = (0.82, 0.79, 0.88, 0.83, 0.88)
# the embedded model's MTP drafts' mean confidence per slot (cpu, fp32, adaptive k = 5, one greedy sequence,
# 2026-12-04): below their acceptance past slot 1, so a calibrator at its prior (survival = confidence) underprices
# them
EMBEDDED_CONFIDENCE = (0.79, 0.57, 0.55, 0.49, 0.51)
MODELS = {
    "h200-b1": DeviceModel(1, StepCostTable([1, 128, 512], _ms(0.321, 0.321, 0.423)),
                           DraftCostTable(5, StepCostTable([1, 64], _ms(0.399, 0.483)),
                                          StepCostTable([1, 64], _ms(0.680, 1.259))),
                           h0=0.50e-3, h_tok=0.064e-3, host_path=0.9e-3, catch_up=0.3e-3, accept=K5_ACCEPT,
                           confidence=EMBEDDED_CONFIDENCE),
    "h200-b64": DeviceModel(64, StepCostTable([1, 128, 512], _ms(0.321, 0.321, 0.423)),
                            DraftCostTable(5, StepCostTable([1, 64], _ms(0.399, 0.483)),
                                           StepCostTable([1, 64], _ms(0.680, 1.259))),
                            h0=0.95e-3, h_tok=0.016e-3, host_path=2.0e-3, catch_up=0.5e-3, accept=K5_ACCEPT,
                            confidence=EMBEDDED_CONFIDENCE),
    # 4 sequences (session 17's sweep, 6829d96): deeper slots accepted less often than at one sequence (k5
    # acceptance 0.50 against k3's 0.71; k3 ran 1.27x of off, k5 1.23x), plain steps ~0.75 ms, the links dearer
    # than the drafting table prices them
    "h200-b4": DeviceModel(4, StepCostTable([1, 128, 512], _ms(0.275, 0.364, 0.376)),
                           DraftCostTable(5, StepCostTable([1, 64], _ms(0.275, 0.364)),
                                          StepCostTable([1, 64], _ms(0.583, 0.828))),
                           h0=0.42e-3, h_tok=0.02e-3, host_path=0.9e-3, catch_up=0.3e-3,
                           accept=(0.80, 0.72, 0.75, 0.55, 0.50), confidence=EMBEDDED_CONFIDENCE, link_factor=2.0),
    # one sequence on an H100 whose drafts are all accepted (session 40's sweep, embedded model, 629bce7: tau 5.75 of a
    # possible 6; plain steps ~0.87 ms, the model's chain of 1 at 1.09 ms and of 5 at 1.34, k5's steps 1.43 ms)
    "h100-b1": DeviceModel(1, StepCostTable([1, 128, 512], _ms(0.321, 0.321, 0.423)),
                           DraftCostTable(5, StepCostTable([1, 64], _ms(0.162, 0.25)),
                                          StepCostTable([1, 64], _ms(0.245, 0.6))),
                           h0=0.48e-3, h_tok=0.064e-3, host_path=0.9e-3, catch_up=0.3e-3, accept=(1.0,) * 5,
                           confidence=EMBEDDED_CONFIDENCE),
    # V2-Lite layer shapes, 8 layers, on an H100 (session 43, the v2-lite-mtp-bench checkpoint: device-bound steps,
    # drafts accepted ~0.85 a slot with a steep dependence on their confidence): the engine's step and drafting
    # tables of that run; plain steps at ~0.6x the table (off 0.98 / 1.26 / 1.64 ms a step at 1 / 4 / 16 sequences)
    # and h0 fitted to static k3's and k5's steps. Every static k ran below off there (k3: 0.91 / 0.87 / 0.95x).
    # accept 1.25 at slope 5 over confidences +-0.2 about the mean: ~0.85 a slot on average (clipped at 0.98 above
    # the mean, at 0.02 near its bottom)
    **{f"h100v8-b{b}": DeviceModel(b, StepCostTable([1, 2, 4, 8, 16, 32, 64, 128, 256, 384],
                                                    _ms(1.129, 1.300, 1.634, 2.105, 2.673, 2.815, 3.140, 3.336, 3.864,
                                                        4.325)),
                                   DraftCostTable(5, StepCostTable([1, 2, 4, 8, 16, 32, 64],
                                                                   _ms(0.640, 0.640, 0.701, 0.859, 0.894, 1.024, 1.206)),
                                                  StepCostTable([1, 2, 4, 8, 16, 32, 64],
                                                                _ms(2.119, 2.189, 2.405, 2.810, 3.155, 3.404, 4.010))),
                                   h0=h0, h_tok=0.01e-3, host_path=0.9e-3, catch_up=0.6e-3, accept=(1.25,) * 5,
                                   confidence=(0.6,) * 5, slope=5.0, plain_factor=pf)
       for b, h0, pf in ((1, 0.35e-3, 0.56), (4, 0.2e-3, 0.65), (16, 0.1e-3, 0.58))},
    # a compute-bound device (this CPU's shape: every verified token and draft link costs about a step's share)
    "cpu-like": DeviceModel(1, StepCostTable([1, 2, 4, 8], _ms(13.0, 16.7, 24.4, 29.6)),
                            DraftCostTable(5, StepCostTable([1, 4], _ms(5.0, 8.9)), StepCostTable([1, 4], _ms(29.0, 59.0))),
                            h0=0.0, h_tok=0.5e-3, host_path=0.5e-3, catch_up=5e-3, accept=(0.62, 0.6, 0.6, 0.6, 0.6),
                            confidence=EMBEDDED_CONFIDENCE),
}


def simulate(model: DeviceModel, mode: str, steps: int, seed: int = 0, host_factor: float = 1.0,
             before: list[tuple[DeviceModel, int]] = (), max_tokens: int | None = None, repeats: int = 1,
             policy_fields: dict | None = None, phase: tuple[int, float] | None = None,
             stretches: tuple[int, float] | None = None) -> dict:
    """mode: "off", "k1".."k5" or "adaptive". Returns tokens per second per sequence, tau and the chains drafted.
    The adaptive policy's own host time (admission, plan, calibration), measured here and scaled by host_factor
    (the device host's speed relative to this one), is added to its steps: the engine pays it on the critical
    path. before: (model, steps) phases the same policy runs first, untimed (the benchmark's warm-up over every
    concurrency: a policy carries its pauses, calibration and step times from one load to the next). policy_fields:
    SlotPolicy fields set on the adaptive policy once made (an A/B of its knobs, `--policy`). phase: (steps, factor),
    closed batches only: a batch's first `steps` steps accept each slot at `factor` times its rate (`--batch-phase`).
    stretches: (steps, factor): the device runs `factor` times slower in stretches (`--stretches`)."""
    rng = random.Random(seed)
    k = len(model.accept)
    if mode == "adaptive":
        policy = SlotPolicy(k=k, max_model_len=1 << 30, calibrator=SurvivalCalibrator(num_slots=k), cost=model.table,
                            draft_cost=model.drafting)
        for name, value in (policy_fields or {}).items():
            owner, _, attr = name.rpartition(".")  # (a dotted name: a part's field, e.g. realized.paired)
            target = getattr(policy, owner, None) if owner else policy
            if target is None or not hasattr(target, attr):
                raise SystemExit(f"--policy {name}: SlotPolicy has no such field")
            if name == "recent_drafts" and isinstance(value, int):  # (a literal: the ring's steps)
                value = RecentDrafts(steps=value)
            setattr(target, attr, value)
    elif mode != "off":
        policy = SlotPolicy(k=int(mode[1:]), max_model_len=1 << 30)
    else:
        policy = None
    for warm, n in before:
        _run(warm, mode, policy, n, rng, host_factor, max_tokens=n if max_tokens else None)
    slow = _Stretches(stretches, rng) if stretches else None
    if not max_tokens:
        return _run(model, mode, policy, steps, rng, host_factor, slow=slow)
    runs = [_run(model, mode, policy, steps, rng, host_factor, max_tokens, phase, slow) for _ in range(repeats)]
    out = dict(runs[-1])
    out["repeats"] = runs
    for key in ("per_seq_tok_s", "total_tok_s", "tau", "mean_chain"):
        out[key] = sum(r[key] for r in runs) / len(runs)
    out["paused_steps"] = sum(r["paused_steps"] for r in runs)
    out["drafting_steps"] = sum(r["drafting_steps"] for r in runs)
    out["decisions"] = dict(policy.decisions) if policy is not None and policy.adaptive else {}
    return out


class _Stretches:
    """The machine's slow stretches (`--stretches STEPS:FACTOR`): each step the device is slow (every step time times
    FACTOR) or not, switching with probability 1 / STEPS a step, so that stretches of either last STEPS steps on
    average. Why: on H100s (sessions 38-40) one sequence's steps ran 1.0-2.2 ms in stretches of tens of steps (the
    machine, not the text), so a chain measured in a slow stretch lost to one measured in a fast one; the model's
    i.i.d. jitter (`noise`) cancels within a few steps and cannot show that."""

    def __init__(self, stretches: tuple[int, float], rng: random.Random):
        self.switch, self.factor, self.rng, self.slow = 1.0 / stretches[0], stretches[1], rng, False

    def __call__(self) -> float:
        if self.rng.random() < self.switch:
            self.slow = not self.slow
        return self.factor if self.slow else 1.0


def _run(model: DeviceModel, mode: str, policy: SlotPolicy | None, steps: int, rng: random.Random,
         host_factor: float, max_tokens: int | None = None, phase: tuple[int, float] | None = None,
         slow: _Stretches | None = None) -> dict:
    """One phase: model.seqs sequences (new ones: no draft held) for `steps` steps under `policy`. With max_tokens,
    a closed batch instead (as benchmarks/speculative.py runs a cell): each sequence ends after max_tokens tokens,
    its drafts clipped to what it may still emit, so the load falls step by step once the first ones end, and the
    phase ends with the last (steps: at most). Each steady step's emitted tokens and time go to the policy's
    realized rates, as SpecStepPipeline passes them."""
    clock = time.perf_counter
    k = len(model.accept)
    left = [max_tokens if max_tokens else 1 << 60] * model.seqs
    held: list[HeldDraft | None] = [None] * model.seqs
    tokens, seconds, verify_seq_steps, emitted_in_verify, chains = 0, 0.0, 0, 0, []
    undrafted = False  # rows kept for a catch-up (a step drafted nothing for some sequence)
    steady = 0  # the chain the last step drafted for every sequence (pipeline._observe_realized)
    paused_steps = 0
    for step in range(steps):
        B = len(left)
        if B == 0:
            break
        if mode == "off":
            dt = (model.table.at(B) * model.plain_factor + model.h0 + model.h_tok * B) \
                * (1 + model.noise * (rng.random() - 0.5))
            dt *= slow() if slow is not None else 1.0
            tokens += B
            seconds += dt
            left = [n - 1 for n in left if n > 1]
            continue
        t_policy = clock()
        cands = [(i, h) for i, h in enumerate(held) if h is not None]
        caps = [min(k, left[i] - 1) for i, _ in cands]
        counts = policy.counts([h for _, h in cands], caps, B, B) if cands else []
        verified = any(counts)
        before = policy.plans_before_the_draw()
        chain = policy.plan_drafting(B) if before else 0
        host = clock() - t_policy
        emitted, slots, confs, acc = 0, [], [], []
        emit = [1] * B
        for (i, h), n in zip(cands, counts):
            a = 0
            while a < n:
                p = min(max(model.accept[a] + model.slope * (h.confidence[a] - model.confidence[a]), 0.02), 0.98)
                if phase is not None and step < phase[0]:  # a batch's hard first steps (--batch-phase)
                    p *= phase[1]
                ok = rng.random() < p
                slots.append(a)
                confs.append(h.confidence[a])
                acc.append(1.0 if ok else 0.0)
                if not ok:
                    break
                a += 1
            emit[i] = a + 1
        emitted = sum(emit)
        t_policy = clock()
        if slots and policy.calibrator is not None and policy.calibrates():  # (the pipeline's sampling of them)
            policy.calibrator.observe_lists(slots, confs, acc)
        if not before:
            chain = policy.plan_drafting(B)
        host += clock() - t_policy
        left = [n - e for n, e in zip(left, emit)]  # (a sequence that ends here drafts nothing)
        drafting = [policy.chain_length(i) if chain and left[i] > 0 else 0 for i in range(B)]
        if policy.adaptive and policy.probe and chain:
            drafting = [d if i < policy.probe_seqs else 0 for i, d in enumerate(drafting)]
        drafted = sum(1 for d in drafting if d)
        live = sum(1 for n in left if n > 0)
        paused_steps += drafted == 0
        one_sync = before and chain > 0 and len({d for d, n in zip(drafting, left) if n > 0}) == 1 and not undrafted
        verify_tokens = B + sum(counts)
        dt = model.table.at(verify_tokens) * (model.plain_factor if not (verified or drafted) else 1.0) \
            + model.h0 + model.h_tok * emitted
        if drafted:
            priced, pass_only = model.drafting.cost(drafted, max(drafting)), model.drafting.cost(drafted, 1)
            dt += priced + (model.link_factor - 1.0) * (priced - pass_only)  # the links at link_factor their price
        if (verified or drafted) and not one_sync:
            dt += model.host_path
        caught_up = drafted > 0 and undrafted
        if caught_up:
            dt += model.catch_up
        dt *= 1 + model.noise * (rng.random() - 0.5)
        dt *= slow() if slow is not None else 1.0
        if policy.adaptive:
            dt += host * host_factor
        observed = policy.observes_step() if policy.adaptive else True  # (spec/settled_steps.py)
        if policy.adaptive and observed:  # the engine times its output processing (SpecStepPipeline._step)
            policy.observe_output(model.h_tok * emitted, emitted, B)
        if not caught_up:  # (a settled step keeps no step time, its realized rate always: spec/settled_steps.py)
            if observed:
                policy.observe_step(dt, verify_tokens, B, drafted, max(drafting), verified=verified,
                                    off_path=not one_sync, emitted=emitted)
            now = 0 if drafted == 0 else max(drafting) if drafted >= live and not policy.explore else -1
            steady, before_chain = now, steady
            hist = [0] * (max(now, 0) + 2)  # (the pipeline's count of sequences by tokens emitted: paired tokens)
            for e in emit:
                hist[min(e, len(hist) - 1)] += 1
            policy.realized.step(B, before_chain, now, verified, emitted, dt, ended=any(n <= 0 for n in left),
                                 emitted=hist if now > 0 and before_chain == now else None)
        else:  # (a catch-up step: no steady step, nor the next one)
            steady = -1
            policy.realized.tick()
        undrafted = drafted < live  # rows of sequences that drafted nothing wait for their catch-up
        tokens += emitted
        seconds += dt
        if verified:
            verify_seq_steps += B
            emitted_in_verify += emitted
        if drafted:
            chains.append(max(drafting))
        nxt = [HeldDraft(None, 0, [0] * d, [min(max(model.confidence[j] + rng.uniform(-0.2, 0.2), 0.0), 1.0)
                                            for j in range(d)]) if d else None for d in drafting]
        held = [h for h, n in zip(nxt, left) if n > 0]
        left = [n for n in left if n > 0]
    tau = emitted_in_verify / verify_seq_steps if verify_seq_steps else 1.0
    return {"mode": mode, "per_seq_tok_s": tokens / model.seqs / seconds, "total_tok_s": tokens / seconds,
            "tau": tau, "mean_chain": sum(chains) / len(chains) if chains else 0.0, "drafting_steps": len(chains),
            "paused_steps": paused_steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--host-factor", type=float, default=1.0,
                    help="the device host's speed against this one for the policy's own host time (0: leave it out)")
    ap.add_argument("--warm-up", type=int, default=0, metavar="STEPS",
                    help="first run every chosen model of the same device (h200-*) for STEPS steps with the same "
                         "policy, untimed, as benchmarks/speculative.py's warm-up does (16 tokens a concurrency)")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="closed batches (as benchmarks/speculative.py's cells): every sequence ends after this many "
                         "tokens, so the load falls as they end; 0: a constant load for --steps steps")
    ap.add_argument("--repeats", type=int, default=3, help="closed batches a mode runs, one policy throughout")
    ap.add_argument("--seeds", type=int, default=1,
                    help="seeds 0..N-1, each its own run of every mode; with N > 1 the rows are their means, and a "
                         "line gives adaptive over the best static k (with --host-factor 0 a seed is deterministic)")
    ap.add_argument("--batch-phase", default=None, metavar="STEPS:FACTOR",
                    help="closed batches: a batch's first STEPS steps accept each slot at FACTOR times its rate (the "
                         "session-38 H100 traces: at 4 sequences a batch's first ~20 steps emitted about half the "
                         "tokens of its later ones; e.g. 20:0.6)")
    ap.add_argument("--stretches", default=None, metavar="STEPS:FACTOR",
                    help="the device runs FACTOR times slower in stretches of STEPS steps on average (the H100s' slow "
                         "stretches of tens of steps, sessions 38-40; e.g. 30:1.5)")
    ap.add_argument("--policy", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="SlotPolicy fields for the adaptive mode (Python literals: challenge_every=0 time_fit=False; a "
                         "part's field dotted: realized.paired=False)")
    args = ap.parse_args(argv)
    fields = {}
    for item in args.policy:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--policy {item!r}: expected FIELD=VALUE")
        try:
            fields[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--policy {item!r}: the value is not a Python literal") from None

    phase = _steps_factor("--batch-phase", args.batch_phase, "20:0.6", lambda n, f: n >= 0 and 0.0 < f <= 1.0,
                          "STEPS >= 0 and 0 < FACTOR <= 1") if args.batch_phase else None
    stretches = _steps_factor("--stretches", args.stretches, "30:1.5", lambda n, f: n >= 1 and f >= 1.0,
                              "STEPS >= 1 and FACTOR >= 1") if args.stretches else None

    def warm(name: str) -> list[tuple[DeviceModel, int]]:  # the same device's models (its name's first part)
        same = [m for m in args.model if m.split("-")[0] == name.split("-")[0]]
        return [(MODELS[m], args.warm_up) for m in same] if args.warm_up else []

    for name in args.model:
        model = MODELS[name]
        runs = [[simulate(model, mode, args.steps, seed=seed, host_factor=args.host_factor, before=warm(name),
                          max_tokens=args.max_tokens or None, repeats=args.repeats, policy_fields=fields,
                          phase=phase, stretches=stretches)
                 for mode in ("off", "k1", "k3", "k5", "adaptive")] for seed in range(args.seeds)]
        rows = runs[0] if args.seeds == 1 else [_mean_row([seed_rows[i] for seed_rows in runs]) for i in range(5)]
        off = rows[0]["per_seq_tok_s"]
        print(f"{name} ({model.seqs} sequences):")
        for r in rows:
            print(f"  {r['mode']:>8}  {r['per_seq_tok_s']:9.1f} tok/s a sequence  {r['per_seq_tok_s'] / off:5.2f}x  "
                  f"tau {r['tau']:.2f}  mean chain {r['mean_chain']:.2f} over {r['drafting_steps']} drafting steps"
                  + (f", {r['paused_steps']} steps drafting nothing" if r["mode"] != "off" else "")
                  + (" (per repeat: " + " / ".join(f"{x['per_seq_tok_s'] / off:.2f}x" for x in r["repeats"]) + ")"
                     if "repeats" in r else "")
                  + (f"\n            plan decisions {r['decisions']}" if r.get("decisions") else ""))
        if args.seeds > 1:
            best = max(rows[1:4], key=lambda r: r["per_seq_tok_s"])
            print(f"  adaptive / best static ({best['mode']}) {rows[4]['per_seq_tok_s'] / best['per_seq_tok_s']:.3f}, "
                  f"mean over {args.seeds} seeds")
    return 0


def _steps_factor(flag: str, value: str, example: str, ok, rule: str) -> tuple[int, float]:
    """A STEPS:FACTOR flag's value (`--batch-phase`, `--stretches`), refused naming the flag where it is not that
    shape or `ok(steps, factor)` is false (`rule` says what holds)."""
    n, sep, f = value.partition(":")
    try:
        got = (int(n), float(f))
    except ValueError:
        raise SystemExit(f"{flag} {value!r}: expected STEPS:FACTOR, e.g. {example}") from None
    if not sep or not ok(*got):
        raise SystemExit(f"{flag} {value!r}: {rule}")
    return got


def _mean_row(rows: list[dict]) -> dict:
    """One mode's rows over seeds: the means of its rates, tau and chain, the sums of its step counts and decisions
    (per-repeat ratios dropped)."""
    out = {"mode": rows[0]["mode"]}
    for key in ("per_seq_tok_s", "total_tok_s", "tau", "mean_chain"):
        out[key] = sum(r[key] for r in rows) / len(rows)
    for key in ("paused_steps", "drafting_steps"):
        out[key] = sum(r[key] for r in rows)
    decisions: dict[str, int] = {}
    for r in rows:
        for k, v in r.get("decisions", {}).items():
            decisions[k] = decisions.get(k, 0) + v
    out["decisions"] = decisions
    return out


if __name__ == "__main__":
    raise SystemExit(main())
