"""Speculation counters: per-slot conditional acceptance, mean accepted length tau, verification budget."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SpecMetrics:
    """Cumulative over an engine's life. tau = emitted tokens per verifying request-step (1 + accepted)."""

    max_slots: int
    steps: int = 0  # verification steps
    request_steps: int = 0  # (request, step) pairs that verified >= 0 drafted slots
    drafted_slots: int = 0
    verified_slots: int = 0
    accepted_slots: int = 0
    reached: list[int] = field(default_factory=list)  # per slot j: verified and every earlier slot accepted
    accepted: list[int] = field(default_factory=list)  # of those, accepted
    budgets: list[int] = field(default_factory=list)  # slots verified per step (last 1024 steps)
    chains: list[int] = field(default_factory=list)  # MTP chain length per drafting step (last 1024 steps)

    def __post_init__(self) -> None:
        self.reached = [0] * self.max_slots
        self.accepted = [0] * self.max_slots

    def record(self, verified: torch.Tensor | list[int], num_accepted: torch.Tensor | list[int], drafted: int) -> None:
        """verified [B]: slots verified per request this step; num_accepted [B] of them accepted (tensors or host
        lists: the engine passes the lists it holds, with no tensor built to be read back)."""
        v = verified.tolist() if isinstance(verified, torch.Tensor) else verified
        a = num_accepted.tolist() if isinstance(num_accepted, torch.Tensor) else num_accepted
        self.steps += 1
        self.request_steps += len(v)
        self.drafted_slots += drafted
        self.verified_slots += sum(v)
        self.accepted_slots += sum(a)
        if len(v) <= 16:
            for vi, ai in zip(v, a):
                for j in range(min(vi, ai + 1)):
                    self.reached[j] += 1
                    self.accepted[j] += 1 if j < ai else 0
        else:  # slot j is reached by the requests with min(v, a + 1) > j, accepted by those with min(v, a) > j
            vv, aa = np.asarray(v, dtype=np.int64), np.asarray(a, dtype=np.int64)
            for counts, n in ((self.reached, np.minimum(vv, aa + 1)), (self.accepted, np.minimum(vv, aa))):
                above = np.cumsum(np.bincount(n, minlength=self.max_slots + 1)[::-1])[::-1]  # above[j]: n >= j
                for j, x in enumerate(above[1:self.max_slots + 1].tolist()):
                    counts[j] += x
        self.budgets.append(sum(v))
        del self.budgets[:-1024]

    def record_plain(self, num_seqs: int) -> None:
        """A step where num_seqs sequences decoded one token each with no draft verified (record() with zeros)."""
        self.steps += 1
        self.request_steps += num_seqs
        self.budgets.append(0)
        del self.budgets[:-1024]

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted_slots / self.request_steps if self.request_steps else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_slots / self.verified_slots if self.verified_slots else float("nan")

    def conditional_acceptance(self) -> list[float]:
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]

    def record_chain(self, length: int) -> None:
        """One drafting step made MTP chains of `length` drafts (the static k, or the adaptive choice)."""
        self.chains.append(length)
        del self.chains[:-1024]

    @property
    def mean_chain(self) -> float:
        return sum(self.chains) / len(self.chains) if self.chains else float("nan")

    @property
    def mean_budget(self) -> float:
        return sum(self.budgets) / len(self.budgets) if self.budgets else float("nan")

    def stats_fields(self, method: str, async_steps: int = 0) -> dict:
        """The EngineStats spec_* fields (method: the drafter; async_steps: pause steps run async)."""
        return dict(spec_method=method, spec_steps=self.steps, spec_request_steps=self.request_steps,
                    spec_drafted_tokens=self.verified_slots, spec_accepted_tokens=self.accepted_slots,
                    spec_tau=self.tau, spec_acceptance_rate=self.acceptance_rate,
                    spec_conditional_acceptance=tuple(self.conditional_acceptance()),
                    spec_mean_budget=self.mean_budget, spec_mean_chain=self.mean_chain, spec_async_steps=async_steps)
