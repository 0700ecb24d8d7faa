"""What the leader sends every rank each step, and what a replica sends back (driver.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class AddCommand:
    """One request as every rank of its replica enqueues it (already validated by the leader)."""

    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    base_seed: int
    dp_rank: int


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class StepCommand:
    seq: int
    kind: str = "step"  # "step" | "noop" | "stop"
    ops: list[AddCommand | AbortCommand] = field(default_factory=list)  # in the order the leader took them
    all_outputs: bool = True
    rebalance: bool = False  # EPLB: recompute the expert placement after this step


@dataclass
class ReplicaReport:
    """What a replica's tp-rank-0 sends the leader after a step."""

    dp_rank: int
    outputs: list
    finished_ids: list[str]
    unfinished: bool
    stats: Any = None  # the replica's EngineStats after the step
    pending: bool = False  # a step still in flight (async scheduling): has_unfinished_requests stays True
