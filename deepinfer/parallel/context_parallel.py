"""Context-parallel prefill: which query tokens of a step each "cp" rank computes (a pure plan).

A step is split when its prefill tokens (the query tokens of requests with more than one) reach
EngineConfig.cp_min_prefill_tokens and at least one request has 2 * cp query tokens or more; any other
step runs whole on every cp rank, exactly as in one process (same inputs, same ops, same bits).

In a split step every query token has exactly one owner rank:
- a request with at least 2 * cp query tokens is cut into 2 * cp contiguous chunks as equal as possible
  (the first n % (2 * cp) chunks one token longer) and rank r takes chunks r and 2 * cp - 1 - r (the
  "zigzag" split of ring / zigzag attention and of SGLang's and vLLM's prefill context parallelism). Under
  causal attention a query at position p attends to p + 1 keys, so the early chunk a rank holds is as
  cheap as its late chunk is dear: each rank gets about the same attention work, not just the same
  number of tokens;
- a shorter request (a decode row, a short prefill or chunk) goes whole to the rank with the fewest tokens
  so far (longest first; ties: the lowest rank), so the MoE / MLP work stays balanced too.

Each contiguous run of a request's tokens on one rank is a `Segment`: in that rank's batch it is one row of
its own, an extend over the request's context up to its first token, sharing the request's block table
(two segments of one request are two rows with their own causal context lengths). The plan is computed
from host lists only, identically on every cp rank, so the ranks agree on every shape of the step's
collectives without exchanging anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.errors import ConfigError


@dataclass(frozen=True)
class Segment:
    """Query rows start .. start + length - 1 of request `request` (its index in the step's batch)."""

    request: int
    start: int
    length: int


@dataclass
class ContextParallelPlan:
    """Each rank's segments (in batch order) and the step rows they cover (rows of the step's [T] tensors)."""

    cp_size: int
    segments: list[list[Segment]]
    rows: list[list[int]] = field(default_factory=list)

    def owner_of_rows(self, num_rows: int) -> list[tuple[int, int]]:
        """(rank, its local row) for every row of the step."""
        owner: list[tuple[int, int] | None] = [None] * num_rows
        for rank, rows in enumerate(self.rows):
            for local, row in enumerate(rows):
                owner[row] = (rank, local)
        missing = [r for r, o in enumerate(owner) if o is None]
        if missing:  # pragma: no cover - plan_context_parallel covers every row
            raise ConfigError(f"context-parallel plan leaves step rows {missing[:8]} without an owner")
        return owner  # type: ignore[return-value]


def zigzag_bounds(num_tokens: int, cp_size: int) -> list[tuple[int, int]]:
    """The 2 * cp_size chunks [start, end) of num_tokens query tokens, as equal as possible (the first
    num_tokens % (2 * cp_size) chunks one longer)."""
    if cp_size < 1 or num_tokens < 0:
        raise ConfigError(f"zigzag_bounds: cp_size {cp_size} must be >= 1 and num_tokens {num_tokens} >= 0")
    n_chunks = 2 * cp_size
    base, extra = divmod(num_tokens, n_chunks)
    bounds, start = [], 0
    for c in range(n_chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def zigzag_segments(request: int, num_tokens: int, cp_size: int, rank: int) -> list[Segment]:
    """Rank `rank`'s share of one request: chunks rank and 2 * cp_size - 1 - rank (one segment when they touch,
    as the middle rank's two chunks do)."""
    bounds = zigzag_bounds(num_tokens, cp_size)
    (a0, a1), (b0, b1) = bounds[rank], bounds[2 * cp_size - 1 - rank]
    if a1 == b0:
        return [Segment(request, a0, b1 - a0)]
    return [s for s in (Segment(request, a0, a1 - a0), Segment(request, b0, b1 - b0)) if s.length > 0]


def plan_context_parallel(query_lens: list[int], cp_size: int, min_prefill_tokens: int) -> ContextParallelPlan | None:
    """The split of one step over cp_size ranks, or None when the step runs whole on every rank (module
    docstring: too few prefill tokens, or no request long enough to give every rank a share)."""
    if cp_size <= 1:
        return None
    prefill = sum(q for q in query_lens if q > 1)
    if prefill < min_prefill_tokens or not any(q >= 2 * cp_size for q in query_lens):
        return None
    segments: list[list[Segment]] = [[] for _ in range(cp_size)]
    load = [0] * cp_size
    for i, q in enumerate(query_lens):
        if q >= 2 * cp_size:
            for r in range(cp_size):
                share = zigzag_segments(i, q, cp_size, r)
                segments[r].extend(share)
                load[r] += sum(s.length for s in share)
    # after the long ones, longest first (so the short ones even out the ranks), each to the lightest rank
    short = sorted((i for i, q in enumerate(query_lens) if 0 < q < 2 * cp_size), key=lambda i: (-query_lens[i], i))
    for i in short:
        r = min(range(cp_size), key=lambda k: (load[k], k))
        segments[r].append(Segment(i, 0, query_lens[i]))
        load[r] += query_lens[i]
    starts, acc = [], 0
    for q in query_lens:
        starts.append(acc)
        acc += q
    rows = []
    for r in range(cp_size):
        segments[r].sort(key=lambda s: (s.request, s.start))
        rows.append([starts[s.request] + s.start + j for s in segments[r] for j in range(s.length)])
    return ContextParallelPlan(cp_size, segments, rows)
