"""The collective cases run on every rank of a real group (collectives.py runs them).

Each rank draws every rank's input from a generator seeded by (seed, case, group rank), so it knows what
the others hold and computes its own expected output locally: the expected value per rank is the contract's
definition (backend/communicator.py) applied to those inputs, never another communicator's answer.

- data movement (all_gather, all_to_all, broadcast): bit-exact;
- sums (all_reduce, reduce_scatter): within n * u * sum|x_i| of the exact (float64) sum, u the dtype's unit
  roundoff: the bound any order of n-1 roundings meets, so a transport that sums in the dtype hop by hop and
  one that accumulates in fp32 both pass, and a wrong sum (a rank missing, a chunk swapped) fails. Small
  integers, whose sums every dtype holds exactly, are checked bit-exact too;
- error cases: the call must raise BackendError naming the bad argument, on every rank, before anything is
  sent (the cases after them then show the group is still in step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# unit roundoff of each dtype's significand (torch.finfo(dt).eps / 2)
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Inputs = Callable[[torch.Generator, int, int, torch.dtype], torch.Tensor]  # (gen, group rank, n, dtype) -> x


@dataclass(frozen=True)
class CollectiveCase:
    op: str  # a COLLECTIVE_OPS entry
    name: str
    make: Inputs
    call: Callable  # (comm, x, rank, n) -> output
    expect: Callable | None  # (every rank's x, rank, n) -> expected output; None for error cases
    compare: str = "exact"  # exact | sum
    same_on_every_rank: bool = False  # the output must be bit-identical on every rank of the group
    error: str | None = None  # an error case: the BackendError must name this argument
    dtypes: tuple[torch.dtype, ...] | None = None  # fixed dtypes; None: the run's


def _rand(g: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _ints(g: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(-2, 3, shape, generator=g).to(dtype)


def _sum(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in xs]).sum(0)


def uneven(r: int, j: int) -> int:
    """Rows rank r sends rank j in the uneven case: 0, 1 or 2, with zero-size chunks on every rank."""
    return (r + 2 * j) % 3


def rank0_silent(r: int, j: int) -> int:
    """Rank 0 sends nothing at all (an empty x); the others 1 or 2 rows to each rank."""
    return 0 if r == 0 else (r + j) % 2 + 1


def _a2a_expect(sizes: Callable[[int, int], int]):
    def expect(xs, r, n):
        return torch.cat([xs[j].split([sizes(j, k) for k in range(n)])[r] for j in range(n)])

    return expect


def _a2a_make(sizes: Callable[[int, int], int], d: int):
    def make(g, r, n, dt):
        return _rand(g, sum(sizes(r, j) for j in range(n)), d, dtype=dt)

    return make


def collective_cases(world: int, t: int = 3, d: int = 8) -> list[CollectiveCase]:
    """The cases for a group of `world` ranks: every op, the uneven and empty all_to_all, the error cases."""
    n = world
    cases = [
        CollectiveCase("all_reduce", f"[{t}, {d}] random", lambda g, r, n, dt: _rand(g, t, d, dtype=dt),
                       lambda c, x, r, n: c.all_reduce(x), lambda xs, r, n: _sum(xs), "sum", True),
        CollectiveCase("all_reduce", f"[{t}, {d}] small integers (exact sums)",
                       lambda g, r, n, dt: _ints(g, t, d, dtype=dt),
                       lambda c, x, r, n: c.all_reduce(x), lambda xs, r, n: _sum(xs).to(xs[0].dtype), "exact", True),
        CollectiveCase("all_reduce", f"[{t}, {d}] non-contiguous (a transposed view)",
                       lambda g, r, n, dt: _rand(g, d, t, dtype=dt).t(),
                       lambda c, x, r, n: c.all_reduce(x), lambda xs, r, n: _sum(xs), "sum", True),
    ]
    for dim, shape in ((0, (t, d)), (-1, (t, d)), (1, (2, t, d)), (-1, (0, d))):
        cases.append(CollectiveCase(
            "all_gather", f"{list(shape)} dim={dim}", lambda g, r, n, dt, s=shape: _rand(g, *s, dtype=dt),
            lambda c, x, r, n, dim=dim: c.all_gather(x, dim=dim), lambda xs, r, n, dim=dim: torch.cat(xs, dim),
            same_on_every_rank=True))
    for dim, shape in ((0, (2 * n, d)), (1, (t, 3 * n)), (-1, (2, t, n))):
        cases.append(CollectiveCase(
            "reduce_scatter", f"{list(shape)} dim={dim}", lambda g, r, n, dt, s=shape: _rand(g, *s, dtype=dt),
            lambda c, x, r, n, dim=dim: c.reduce_scatter(x, dim=dim),
            lambda xs, r, n, dim=dim: _sum(xs).chunk(n, dim)[r], "sum"))
    cases += [
        CollectiveCase("all_to_all", f"[{2 * n}, {d}] equal splits (None)",
                       lambda g, r, n, dt: _rand(g, 2 * n, d, dtype=dt), lambda c, x, r, n: c.all_to_all(x),
                       _a2a_expect(lambda j, k: 2)),
        CollectiveCase("all_to_all", "uneven splits with zero-size chunks",
                       _a2a_make(uneven, d),
                       lambda c, x, r, n: c.all_to_all(x, [uneven(r, j) for j in range(n)],
                                                       [uneven(j, r) for j in range(n)]),
                       _a2a_expect(uneven)),
        CollectiveCase("all_to_all", "uneven splits, output_splits=None (exchanged)", _a2a_make(uneven, d),
                       lambda c, x, r, n: c.all_to_all(x, [uneven(r, j) for j in range(n)]), _a2a_expect(uneven)),
        CollectiveCase("all_to_all", "rank 0 sends nothing (empty x)", _a2a_make(rank0_silent, d),
                       lambda c, x, r, n: c.all_to_all(x, [rank0_silent(r, j) for j in range(n)],
                                                       [rank0_silent(j, r) for j in range(n)]),
                       _a2a_expect(rank0_silent)),
    ]
    for src in sorted({n - 1, 0}):
        cases.append(CollectiveCase(
            "broadcast", f"[{t}, {d}] from group rank {src}", lambda g, r, n, dt: _rand(g, t, d, dtype=dt),
            lambda c, x, r, n, src=src: c.broadcast(x, src=src), lambda xs, r, n, src=src: xs[src],
            same_on_every_rank=True))
    cases += _error_cases(n, t, d)
    # after the error cases: the group is still in step
    cases.append(CollectiveCase("all_reduce", f"[{t}, {d}] after the error cases",
                                lambda g, r, n, dt: _ints(g, t, d, dtype=dt), lambda c, x, r, n: c.all_reduce(x),
                                lambda xs, r, n: _sum(xs).to(xs[0].dtype), "exact", True, dtypes=(torch.float32,)))
    return cases


def _error_cases(n: int, t: int, d: int) -> list[CollectiveCase]:
    fp32 = (torch.float32,)

    def err(op: str, name: str, rows: int, call, arg: str) -> CollectiveCase:
        return CollectiveCase(op, f"error: {name}", lambda g, r, n, dt: _rand(g, rows, d, dtype=dt), call, None,
                              error=arg, dtypes=fp32)

    cases = [
        err("all_to_all", "input_splits do not sum to the rows", 2 * n,
            lambda c, x, r, n: c.all_to_all(x, [2] * (n - 1) + [3], [2] * n), "input_splits"),
        err("all_to_all", "output_splits of the wrong length", 2 * n,
            lambda c, x, r, n: c.all_to_all(x, [2] * n, [2] * (n + 1)), "output_splits"),
        err("all_to_all", "a negative split", 2 * n,
            lambda c, x, r, n: c.all_to_all(x, [2] * n, [-1] + [2] * (n - 1)), "output_splits"),
        err("all_gather", "dim out of range", t, lambda c, x, r, n: c.all_gather(x, dim=2), "dim"),
        err("broadcast", "src outside the group", t, lambda c, x, r, n: c.broadcast(x, src=n), "src"),
    ]
    if n > 1:  # one rank divides everything
        cases += [
            err("all_to_all", "input_splits=None with rows that do not divide", 2 * n + 1,
                lambda c, x, r, n: c.all_to_all(x), "input_splits"),
            err("reduce_scatter", "a dim that does not divide", 2 * n + 1,
                lambda c, x, r, n: c.reduce_scatter(x, dim=0), "dim"),
        ]
    return cases
