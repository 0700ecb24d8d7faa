"""Where a speculative step's wall time goes, by phase and kind of step: what a benchmark compares between the
adaptive mode and a static k at one load (benchmarks/speculative.py prints it per cell).

Phases of SpecStepPipeline._step (spec/pipeline.py), in order:
- schedule: the scheduler's step;
- slots: the draft slots (the admission, SlotPolicy.counts, and the KV cover; with the launch's "plan" part, what
  the slot policy's host time counts, less the calibration);
- launch: batch building, the forward's and the sampler's launches, and for a step off the one-sync path its waits
  for the device (the draw's read-back, the MTP drafter's);
- overlap: an overlapped step's host time between its launch and its read-back (spec/overlap.py): the text and
  bookkeeping of the step before, the engine's output and its caller's work between the engine calls; the device
  runs the step meanwhile (0 for every other kind);
- deferred: the metrics, calibration and (adaptive) the policy's step observations, run while the host waits for
  the device (`_run_deferred`): hidden where the device is still busy;
- wait: a one-sync step's read-back wait (spec/one_sync.py): the device's work not overlapped by the host's;
- process: output processing, rollback and the book of next drafts;
- observe: the adaptive policy's step observations (step times, output time, realized rates).

Parts of "launch" (recorded beside the phases, not in their total): build (the batch and its decode-rows form),
forward (the forward's launch: the graph's inputs loaded, its replay), plan (the chain plan and the one-sync
qualification, once the forward is launched: SpecStepPipeline._plan_chain; before session 41 part of "slots"), stage (the one-sync step's rooms and staging,
once the forward is launched), sample (logits and the draw's launches), draft (a host-path step's MTP pass and
chain after its draw, their read-back included: spec/next_drafts.py); the rest of "launch" is the one-sync step's
verification, pass and chain's launches, and the host path's draw and verification.

Kinds: "one_sync" (verification, pass and chain on the device, one read-back), "overlapped" (a one-sync step whose
read-back was the next engine call's, spec/overlap.py; its "process" is the token level only, its text in the next
step's "overlap"), "chained" (an overlapped step launched on the device results of the one before, async
scheduling: spec/chained_steps.py; its "schedule" and "slots" are 0, its "launch" its build and launches), "host" (the host path: a probe's
verification, a step with prompt chunks), "catch_up" (a host-path step whose MTP pass also ran a pause's kept rows,
spec/mtp_catchup.py; since 2026-12-05 apart from "host", whose steps at 64 sequences averaged 79 ms on the H200 in
session 17's sweep with their forward at 1.3 ms: "draft" says how much of that is the catch-up pass), "plain"
(nothing verified nor drafted: an adaptive pause step run on the spec path), "async_pause" (a pause step handed to
spec/async_pauses.py: its inner async step, schedule to the previous step's output processing, all in "launch", the
pause's bookkeeping in "observe"; tokens: the step launched). Non-adaptive and adaptive engines record the same
phases, so their steps compare directly; the cost is one clock read per phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("schedule", "slots", "launch", "overlap", "deferred", "wait", "process", "observe")
LAUNCH_PARTS = ("build", "forward", "plan", "stage", "sample", "draft")  # parts of "launch" (module docstring)


@dataclass
class StepPhases:
    """Seconds by (kind, phase) and steps by kind, summed over the engine's life (a benchmark takes differences)."""

    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # forward tokens (verify and decode rows) by kind

    def add(self, kind: str, phases: dict[str, float], num_tokens: int) -> None:
        """One step of this kind: seconds per phase (PHASES' names)."""
        for phase, s in phases.items():
            if phase not in PHASES and phase not in LAUNCH_PARTS:
                raise ValueError(f"unknown step phase {phase!r}; phases are {PHASES}, parts of launch {LAUNCH_PARTS}")
            self.seconds[(kind, phase)] = self.seconds.get((kind, phase), 0.0) + s
        self.steps[kind] = self.steps.get(kind, 0) + 1
        self.tokens[kind] = self.tokens.get(kind, 0) + num_tokens

    def snapshot(self) -> StepPhases:
        return StepPhases(dict(self.seconds), dict(self.steps), dict(self.tokens))

    def since(self, before: StepPhases) -> StepPhases:
        """What was recorded after `before` (a snapshot of this one)."""
        return StepPhases({k: v - before.seconds.get(k, 0.0) for k, v in self.seconds.items()},
                          {k: v - before.steps.get(k, 0) for k, v in self.steps.items()},
                          {k: v - before.tokens.get(k, 0) for k, v in self.tokens.items()})

    def plus(self, other: StepPhases | None) -> StepPhases:
        """This and `other` together (None: this one)."""
        if other is None:
            return self

        def add(a: dict, b: dict) -> dict:
            return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}

        return StepPhases(add(self.seconds, other.seconds), add(self.steps, other.steps),
                          add(self.tokens, other.tokens))

    def per_step_ms(self) -> dict[str, dict[str, float]]:
        """kind -> {"steps", "tokens" (a step's forward tokens), each phase's ms a step, "total" (of the phases),
        and each part of launch recorded for the kind}, kinds with steps."""
        out: dict[str, dict[str, float]] = {}
        for kind, n in sorted(self.steps.items()):
            if n <= 0:
                continue
            row = {"steps": float(n), "tokens": self.tokens.get(kind, 0) / n}
            row.update({p: 1e3 * self.seconds.get((kind, p), 0.0) / n for p in PHASES})
            row["total"] = sum(row[p] for p in PHASES)
            row.update({p: 1e3 * self.seconds[(kind, p)] / n for p in LAUNCH_PARTS if (kind, p) in self.seconds})
            out[kind] = row
        return out

    def describe(self) -> str:
        """One line per kind: steps, tokens a step and ms a step by phase (what benchmarks print)."""
        lines = []
        for kind, row in self.per_step_ms().items():
            parts = [p for p in LAUNCH_PARTS if p in row]
            lines.append(f"{kind}: {int(row['steps'])} steps, {row['tokens']:.1f} tok, {row['total']:.3f} ms = "
                         + " + ".join(f"{p} {row[p]:.3f}" for p in PHASES)
                         + (" (launch: " + ", ".join(f"{p} {row[p]:.3f}" for p in parts) + ")" if parts else ""))
        return "; ".join(lines) if lines else "no steps"
