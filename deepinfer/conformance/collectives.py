"""The collectives' conformance over N real ranks: `deepinfer check --device cpu --world-size N`.

The one-rank suite (cases.py `_collective_cases`) can only see the identity; this one spawns N local ranks
on a gloo group (deepinfer/parallel/local_ranks.py), builds the backend on every rank, installs the
communicators of a layout through the backend (`build_communicators` + `install_communicators`, the path the
engine takes) and runs collective_cases.py on each group of several ranks: the whole world as "tp", and
with 4+ ranks also TP=2 x DP=N/2, whose "dp" groups hold non-consecutive global ranks (so `broadcast(src)`
must map the group rank). Every rank reports a row per case; rows that must be bit-identical across the
ranks of a group are compared after the run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Iterable

import torch

from deepinfer.backend import COLLECTIVE_OPS
from deepinfer.conformance.collective_cases import FLOAT_DTYPES, UNIT_ROUNDOFF, CollectiveCase, collective_cases
from deepinfer.errors import BackendError, ConfigError

SHAPES = {"tiny": (3, 8), "real": (64, 2048)}  # (rows t, width d) of the cases


@dataclass
class CollectiveRow:
    layout: str  # e.g. "TP=2 x DP=2"
    group: str  # "tp" | "dp"
    ranks: tuple[int, ...]  # the group's global ranks, in group-rank order
    rank: int  # this row's global rank
    op: str
    case: str
    dtype: str
    status: str  # pass | fail | error
    max_abs_err: float | None = None
    reason: str = ""
    digest: str = ""  # of the output, for the bit-identical-on-every-rank check
    same_on_every_rank: bool = False

    @property
    def key(self) -> tuple:
        return self.layout, self.group, self.op, self.case, self.dtype


@dataclass
class CollectiveReport:
    backend: str
    world_size: int
    seed: int
    rows: list[CollectiveRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.status == "pass" for r in self.rows)

    def per_rank(self) -> dict[int, dict[str, int]]:
        out = {r: {"pass": 0, "fail": 0, "error": 0} for r in range(self.world_size)}
        for row in self.rows:
            out[row.rank][row.status] += 1
        return out

    def to_dict(self) -> dict:
        return {"backend": self.backend, "world_size": self.world_size, "seed": self.seed, "ok": self.ok,
                "per_rank": {str(k): v for k, v in self.per_rank().items()},
                "rows": [asdict(r) for r in self.rows]}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def format_table(self) -> str:
        """One line per (layout, group, op, case, dtype) with each rank's status; then each rank's tally."""
        cells: dict[tuple, dict[int, CollectiveRow]] = {}
        for row in self.rows:
            cells.setdefault(row.key, {})[row.rank] = row
        ranks = list(range(self.world_size))
        header = ["layout", "group", "op", "case", "dtype", *[f"r{r}" for r in ranks]]
        lines = [[*k[:2], *k[2:], *[cells[k][r].status.upper() if r in cells[k] else "-" for r in ranks]]
                 for k in cells]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [f"collectives: backend {self.backend}, {self.world_size} ranks (gloo), seed {self.seed}",
               fmt.format(*header).rstrip(), *(fmt.format(*line).rstrip() for line in lines)]
        for row in self.rows:
            if row.status != "pass":
                out.append(f"rank {row.rank} {row.layout} {row.group} {row.op} [{row.case}] {row.dtype}: "
                           f"{row.status.upper()}: {row.reason}")
        for r, c in self.per_rank().items():
            out.append(f"rank {r}: {c['pass']} passed, {c['fail']} failed, {c['error']} errors")
        out.append("OK" if self.ok else "FAILED")
        return "\n".join(out)


def check_layouts(world_size: int):
    """The layouts the check runs: the whole world as one group; with 4+ (even) ranks also TP=2 x DP=N/2."""
    from deepinfer.parallel.layout import ParallelLayout

    layouts = [ParallelLayout(world_size)]
    if world_size >= 4 and world_size % 2 == 0:
        layouts.append(ParallelLayout(2, world_size // 2))
    return layouts


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()[:16]


def _compare(case: CollectiveCase, out: torch.Tensor, xs: list[torch.Tensor], r: int, n: int,
             dtype: torch.dtype) -> tuple[bool, float | None, str]:
    want = case.expect(xs, r, n)
    if tuple(out.shape) != tuple(want.shape):
        return False, None, f"shape {tuple(out.shape)}, expected {tuple(want.shape)}"
    if out.dtype != dtype:
        return False, None, f"dtype {out.dtype}, expected {dtype}"
    got = out.detach().cpu()
    err = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    if case.compare == "exact":
        ok = torch.equal(got, want.to(dtype))
        return ok, err, "" if ok else f"not bit-exact (max error {err:.3g})"
    # the same reduction of |x|: sum_i |x_i| where the output is a sum (the chunk of it for reduce_scatter)
    bound = n * UNIT_ROUNDOFF[dtype] * case.expect([x.double().abs() for x in xs], r, n)
    excess = float(((got.double() - want).abs() - bound).max()) if got.numel() else 0.0
    ok = excess <= 0.0
    return ok, err, "" if ok else f"error {err:.3g} beyond n*u*sum|x| (by {excess:.3g})"


def run_cases_on(comm, layout: str, group: str, ranks: list[int], seed: int, dtypes: Iterable[torch.dtype],
                 device: torch.device, shapes: str = "tiny", ops: Iterable[str] | None = None) -> list[CollectiveRow]:
    """Every collective case (of `ops`) on this rank of `comm`; the rows say pass / fail / error and why.
    Every rank of the group must call it with the same arguments (the same cases, in the same order)."""
    n, r = comm.world_size, comm.rank
    rows = []
    want_ops = set(ops) if ops else None
    for index, case in enumerate(collective_cases(n, *SHAPES[shapes])):
        if want_ops is not None and case.op not in want_ops:
            continue
        for dtype in case.dtypes or tuple(dtypes):
            row = CollectiveRow(layout, group, tuple(ranks), ranks[r], case.op, case.name,
                                str(dtype).removeprefix("torch."), "pass", same_on_every_rank=case.same_on_every_rank)
            rows.append(row)
            xs = [case.make(torch.Generator().manual_seed(seed * 1_000_003 + index * 1_009 + j), j, n, dtype)
                  for j in range(n)]
            x = xs[r].to(device)
            before = x.clone()
            try:
                out = case.call(comm, x, r, n)
            except BackendError as exc:
                if case.error is None:
                    row.status, row.reason = "error", f"BackendError: {exc}"
                elif f"{case.error}=" not in str(exc):
                    row.status, row.reason = "fail", f"the error does not name {case.error!r}: {exc}"
                continue
            except Exception as exc:  # a crash is a row, not the end of the check
                row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"
                continue
            if case.error is not None:
                row.status, row.reason = "fail", f"bad {case.error} raised no BackendError"
                continue
            if not torch.equal(x, before):
                row.status, row.reason = "fail", "modified its input (the ops are out of place)"
                continue
            ok, row.max_abs_err, reason = _compare(case, out, xs, r, n, dtype)
            row.digest = _digest(out)
            if not ok:
                row.status, row.reason = "fail", reason
    return rows


def collective_rank_main(rank: int, world_size: int, backend_name: str, seed: int, dtype_names: list[str],
                         shapes: str = "tiny", ops: list[str] | None = None) -> list[CollectiveRow]:
    """What each spawned rank runs (module-level: run_local_ranks pickles it)."""
    from deepinfer.backend.registry import default_registry
    from deepinfer.parallel.groups import build_communicators

    backend = default_registry().create(backend_name)
    dtypes = [getattr(torch, d) for d in dtype_names]
    rows: list[CollectiveRow] = []
    for layout in check_layouts(world_size):
        backend.install_communicators(build_communicators(layout, rank, backend))
        coords = layout.coords(rank)
        for group, ranks in (("tp", layout.tp_group_ranks(coords.dp_rank)),
                             ("dp", layout.dp_group_ranks(coords.tp_rank))):
            comm = backend.communicator(group)
            if comm.world_size != len(ranks):
                raise BackendError(f"backend.communicator({group!r}) spans {comm.world_size} ranks, the layout "
                                   f"{layout.describe()} says {len(ranks)}")
            if len(ranks) > 1:
                rows += run_cases_on(comm, layout.describe().split(" (")[0], group, ranks, seed, dtypes,
                                     backend.device, shapes, ops)
    return rows


def check_same_on_every_rank(rows: list[CollectiveRow]) -> None:
    """Rows whose output must be bit-identical across a group's ranks fail where the digests differ."""
    by_instance: dict[tuple, list[CollectiveRow]] = {}
    for row in rows:
        if row.same_on_every_rank and row.status == "pass":
            by_instance.setdefault((*row.key, row.ranks), []).append(row)
    for group_rows in by_instance.values():
        if len({row.digest for row in group_rows}) > 1:
            for row in group_rows:
                row.status, row.reason = "fail", "the output differs between the ranks of the group"


def run_collectives(device: str = "cpu", world_size: int = 2, *, seed: int = 0,
                    dtypes: Iterable[torch.dtype] | None = None, shapes: str = "tiny",
                    ops: Iterable[str] | None = None, timeout_s: float = 120.0) -> CollectiveReport:
    """Spawn `world_size` gloo ranks, run the collective cases (of `ops`, default all) on each, return the
    per-rank report."""
    from deepinfer.parallel.local_ranks import run_local_ranks

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ConfigError(f"--world-size must be an integer >= 2 for the multi-rank check (got {world_size!r})")
    want = tuple(dtypes) if dtypes is not None else FLOAT_DTYPES
    bad = [d for d in want if d not in FLOAT_DTYPES]
    if bad:
        raise ConfigError(f"--dtype {bad}: the collective cases run {[str(d) for d in FLOAT_DTYPES]}")
    if shapes not in SHAPES:
        raise ConfigError(f"--shapes {shapes!r}: choose one of {sorted(SHAPES)}")
    want_ops = sorted(set(ops)) if ops else list(COLLECTIVE_OPS)
    unknown = sorted(set(want_ops) - set(COLLECTIVE_OPS))
    if unknown:
        raise ConfigError(f"--op {unknown}: the collectives are {', '.join(COLLECTIVE_OPS)}")
    from deepinfer.backend.registry import default_registry

    info = default_registry().resolve(device)
    if info.device_type != "cpu":
        raise BackendError(f"--world-size runs the collectives on gloo over the CPU; backend {info.name!r} "
                           f"(device {info.device_type}) needs one device per rank and its own transport, "
                           "which this check does not launch yet")
    name = info.name
    per_rank = run_local_ranks(collective_rank_main, world_size, name, seed,
                               [str(d).removeprefix("torch.") for d in want], shapes, want_ops,
                               timeout_s=timeout_s)
    report = CollectiveReport(backend=name, world_size=world_size, seed=seed,
                              rows=[row for rows in per_rank for row in rows])
    check_same_on_every_rank(report.rows)
    return report
