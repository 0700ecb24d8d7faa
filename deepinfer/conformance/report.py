"""Conformance results: one row per (op, case, dtype), like ggml's test-backend-ops output."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

STATUSES = ("pass", "fail", "error", "unsupported")


@dataclass
class ConformanceRow:
    op: str  # an OP_NAMES entry, e.g. "mla_attention"
    case: str  # what the inputs look like, e.g. "decode ctx=9 H=4"
    dtype: str  # "float32" | "bfloat16" | "float16"
    status: str  # pass | fail | error | unsupported
    impl: str = ""  # the backend's op_coverage() entry for this op
    max_abs_err: float | None = None
    err_ratio: float | None = None  # max |a-b| / (atol + rtol |ref|); pass when <= 1
    atol: float | None = None
    rtol: float | None = None
    reason: str = ""  # why it failed, errored or is unsupported
    seconds: float = 0.0


@dataclass
class ConformanceReport:
    backend: str
    device: str
    shapes: str
    seed: int
    rows: list[ConformanceRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No op failed or raised; unsupported ops are coverage, not failures."""
        return all(r.status in ("pass", "unsupported") for r in self.rows) and any(
            r.status == "pass" for r in self.rows
        )

    def ops(self) -> list[str]:
        return sorted({r.op for r in self.rows})

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.rows) for s in STATUSES}

    def coverage(self) -> dict[str, str]:
        """op -> "supported" / "partial" / "unsupported" over all its rows."""
        out = {}
        for op in self.ops():
            states = {r.status != "unsupported" for r in self.rows if r.op == op}
            out[op] = "supported" if states == {True} else "unsupported" if states == {False} else "partial"
        return out

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "device": self.device,
            "shapes": self.shapes,
            "seed": self.seed,
            "ok": self.ok,
            "counts": self.counts(),
            "coverage": self.coverage(),
            "rows": [asdict(r) for r in self.rows],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def format_table(self) -> str:
        header = ("op", "case", "dtype", "status", "err/tol", "max_abs_err", "impl / reason")
        lines = []
        for r in self.rows:
            ratio = "" if r.err_ratio is None else f"{r.err_ratio:.3g}"
            err = "" if r.max_abs_err is None else f"{r.max_abs_err:.3g}"
            note = r.reason if r.status != "pass" else r.impl
            lines.append((r.op, r.case, r.dtype, r.status.upper(), ratio, err, note))
        widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)] if lines else [len(h) for h in header]
        widths[-1] = 0  # the last column runs free
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [f"conformance: backend {self.backend} on {self.device}, shapes {self.shapes}, seed {self.seed}"]
        out.append(fmt.format(*header).rstrip())
        out.extend(fmt.format(*line).rstrip() for line in lines)
        c = self.counts()
        out.append(
            f"{c['pass']} passed, {c['fail']} failed, {c['error']} errors, {c['unsupported']} unsupported "
            f"over {len(self.ops())} ops: {'OK' if self.ok else 'FAILED'}"
        )
        return "\n".join(out)

