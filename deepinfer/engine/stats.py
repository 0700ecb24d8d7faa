"""A snapshot of the engine's load, for metrics and tests (block accounting is exact)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # requests with a sequence in the running batch
    num_waiting: int  # requests with a sequence waiting (new or preempted)
    kv_blocks_used: int  # summed over KV groups
    kv_blocks_total: int
    kv_usage: float  # used fraction of the fullest group, in [0, 1]
    kv_capacity_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    num_requests_finished: int = 0
    num_state_slots_used: int = 0  # rows held by sequences with KV (their per-sequence state rows)
    num_sync_fallbacks: int = 0  # async-scheduling steps that resolved the step in flight first
    kv_blocks_by_group: dict[str, tuple[int, int]] = field(default_factory=dict)  # group -> (used, total)
    prefix_cache_queried_tokens: int = 0  # tokens of sequences looked up in the prefix cache at admission
    prefix_cache_hit_tokens: int = 0  # of which served from it
    prefix_cache_blocks: int = 0  # keyed blocks (held or evictable)
    # speculative decoding (docs/speculative.md; all 0 / NaN / () when it is off)
    spec_method: str | None = None
    spec_steps: int = 0  # steps that verified drafted tokens or decoded
    spec_request_steps: int = 0  # (decoding sequence, step) pairs: the denominator of spec_tau
    spec_drafted_tokens: int = 0  # drafted tokens put up for verification
    spec_accepted_tokens: int = 0  # of which accepted
    spec_tau: float = float("nan")  # mean tokens emitted per decoding sequence-step (1 + accepted)
    spec_acceptance_rate: float = float("nan")  # accepted / verified drafted tokens
    spec_conditional_acceptance: tuple[float, ...] = ()  # per draft slot j: P(accepted | slots < j accepted)
    spec_mean_budget: float = float("nan")  # drafted tokens verified per step (last 1024 steps)
    spec_mean_chain: float = float("nan")  # MTP chain length per drafting step (last 1024; adaptive picks it)
    spec_async_steps: int = 0  # adaptive pause steps run through async scheduling (spec/async_pauses.py)
    spec_overlapped_steps: int = 0  # steps whose read-back was the next engine call's (spec/overlap.py)
    spec_chained_steps: int = 0  # of which launched on the device results of the one before (spec/chained_steps.py)


_SUMMED = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "kv_capacity_tokens",
           "prompt_tokens_total", "generation_tokens_total", "num_preemptions", "num_requests_finished",
           "num_state_slots_used", "num_sync_fallbacks", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens",
           "prefix_cache_blocks")


def merge_replica_stats(replicas: list[EngineStats]) -> EngineStats:
    """One engine's view of several data-parallel replicas (each its own scheduler and KV cache): counts
    and blocks summed, kv_usage the fullest replica's; speculative decoding never runs with replicas, so its
    fields are the first replica's (off)."""
    first = replicas[0]
    if len(replicas) == 1:
        return first
    from dataclasses import replace

    by_group: dict[str, tuple[int, int]] = {}
    for st in replicas:
        for g, (used, total) in st.kv_blocks_by_group.items():
            u, t = by_group.get(g, (0, 0))
            by_group[g] = (u + used, t + total)
    summed = {name: sum(getattr(st, name) for st in replicas) for name in _SUMMED}
    return replace(first, kv_usage=max(st.kv_usage for st in replicas), kv_blocks_by_group=by_group, **summed)
