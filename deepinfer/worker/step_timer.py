"""Device-side timing of launched steps, for benchmarks: where a step's device time goes and how
long the device sits idle between steps.

Why: with async scheduling a step's wall time is max(host, device), and a wall clock alone
cannot say which one bounds it. Events recorded on the stream at fixed points of
`ModelRunner.launch` give each step's device time per phase; the gap between one step's last
event and the next step's first is device idle time (the host queued the next step late). The
host's time blocked in `PendingStep.resolve` waiting for the draw says the converse. Events
only record and never wait; `summary()` synchronizes once at the end.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from deepinfer.errors import DeepInferError

# the points ModelRunner.launch marks, in stream order
PHASES = ("start", "inputs", "forward", "logits", "end")


@dataclass
class StepTimer:
    device: torch.device
    steps: list[dict[str, torch.Event]] = field(default_factory=list)
    host_wait_s: list[float] = field(default_factory=list)  # per resolve: host blocked on the draw
    host_launch_s: list[float] = field(default_factory=list)  # per launch: host time from begin to "end"
    skip_gaps: set[int] = field(default_factory=set)  # steps whose idle gap before them is not the engine's
    _t_begin: float = 0.0

    def __post_init__(self):
        if self.device.type == "cpu":
            raise DeepInferError("StepTimer needs an accelerator: the CPU has no stream events to time")

    def begin(self) -> None:
        self._t_begin = time.perf_counter()
        self.steps.append({})
        self.mark("start")

    def mark(self, phase: str) -> None:
        if phase not in PHASES:
            raise DeepInferError(f"unknown step phase {phase!r}; expected one of {PHASES}")
        ev = torch.Event(device=self.device, enable_timing=True)
        ev.record()
        self.steps[-1][phase] = ev
        if phase == "end":
            self.host_launch_s.append(time.perf_counter() - self._t_begin)

    def exclude_next_gap(self) -> None:
        """The device time before the next step is someone else's (a benchmark replaying a graph between
        two steps, say): leave that gap out of the idle statistics."""
        self.skip_gaps.add(len(self.steps))

    def wait(self, fn):
        """fn() (the host's wait for a draw), timed."""
        t = time.perf_counter()
        out = fn()
        self.host_wait_s.append(time.perf_counter() - t)
        return out

    def summary(self, last: int | None = None) -> dict:
        """Median ms per step of each phase, device idle before each step, and host wait;
        over the last `last` complete steps (all when None)."""
        torch.accelerator.synchronize(self.device)
        index = {id(s): i for i, s in enumerate(self.steps)}
        done = [s for s in self.steps if all(p in s for p in PHASES)]
        if last is not None:
            done = done[-last:]
        if not done:
            return {"timed_steps": 0}
        out: dict[str, float | int] = {"timed_steps": len(done)}
        for a, b in zip(PHASES, PHASES[1:]):
            out[f"{a}_to_{b}_ms"] = statistics.median(s[a].elapsed_time(s[b]) for s in done)
        out["device_ms"] = statistics.median(s["start"].elapsed_time(s["end"]) for s in done)
        gaps = [max(0.0, prev["end"].elapsed_time(cur["start"])) for prev, cur in zip(done, done[1:])
                if index[id(cur)] not in self.skip_gaps]
        if gaps:
            out["idle_ms_median"] = statistics.median(gaps)
            out["idle_ms_mean"] = sum(gaps) / len(gaps)
        periods = [prev["start"].elapsed_time(cur["start"]) for prev, cur in zip(done, done[1:])]
        if periods:
            out["period_ms"] = statistics.median(periods)
        for name, values in (("host_wait_ms", self.host_wait_s), ("host_launch_ms", self.host_launch_s)):
            if values[-len(done):]:
                out[name] = 1e3 * statistics.median(values[-len(done):])
        return out
