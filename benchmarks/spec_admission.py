"""Host time of the confidence scheduler's admission (SlotPolicy.counts), on the CPU: what an adaptive engine pays on
its critical path each step before the forward (spec/slot_policy.py; static k pays a list comprehension).

An adaptive SlotPolicy over a calibration that has seen every slot (5 slots, acceptance 0.9 .. 0.7), a nearly flat
step table and drafting that pays (the shape of the H200's), asked to admit k = 5 drafts per sequence at random
confidences, as the engine asks once a step: median microseconds a call and slots admitted, per concurrency.

    python -m benchmarks.spec_admission --concurrency 1 4 16 64 256
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.draft_cost import DraftCostTable
from deepinfer.spec.draft_slots import HeldDraft
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.spec.slot_policy import SlotPolicy


def make_policy(k: int = 5) -> SlotPolicy:
    cal = SurvivalCalibrator(num_slots=k)
    for j, rate in enumerate([0.9, 0.85, 0.8, 0.75, 0.7][:k]):
        n = 1000
        cal.observe(torch.full((n,), j), torch.rand(n, dtype=torch.float64), (torch.arange(n) < rate * n).double())
    drafts = DraftCostTable(k, StepCostTable([1, 256], [0.06e-3, 0.3e-3]), StepCostTable([1, 256], [0.2e-3, 1e-3]))
    return SlotPolicy(k=k, max_model_len=4096, calibrator=cal, draft_cost=drafts, probe=False, measure_steps=0,
                      cost=StepCostTable([1, 4096], [0.5e-3, 0.505e-3]), mean_confidence=[0.8] * k)


def time_counts(policy: SlotPolicy, seqs: int, calls: int, rng: random.Random) -> tuple[float, int]:
    """Median seconds of one counts() call over `calls` calls (fresh confidences each), and the last one's slots."""
    k = policy.k
    times, admitted = [], 0
    for _ in range(calls):
        held = [HeldDraft(None, 0, [1] * k, [rng.random() for _ in range(k)]) for _ in range(seqs)]
        t = time.perf_counter()
        counts = policy.counts(held, [k] * seqs, seqs, seqs)
        times.append(time.perf_counter() - t)
        admitted = sum(counts)
    return statistics.median(times), admitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    rng = random.Random(0)
    policy = make_policy()
    print(f"{'seqs':>5} {'slots':>6} {'us a call':>10} {'admitted':>9}")
    for b in args.concurrency:
        time_counts(policy, b, 20, rng)  # warm-up
        secs, admitted = time_counts(policy, b, args.calls, rng)
        print(f"{b:>5} {5 * b:>6} {secs * 1e6:>10.1f} {admitted:>9}", flush=True)


if __name__ == "__main__":
    main()
