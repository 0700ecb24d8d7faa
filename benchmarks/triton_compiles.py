"""Which Triton kernels compile while a benchmark's timed work runs, and how long each took.

Why: in issue 17's sweeps on the GPU the adaptive mode's catch-up steps at 256 sequences took 0.7-1.2 s (sessions
20 and 25, docs/speculative.md), where such a step's work takes a few ms; a kernel compiled at a shape the warm-up
never ran (a new constexpr choice) is the suspect, and nothing recorded compiles. `CompileLog` installs Triton's
JIT hooks (`triton.knobs.runtime.jit_cache_hook`, called before a kernel is compiled or loaded from the on-disk
cache, and `jit_post_compile_hook`, after), chained with hooks already installed, and records each kernel's name,
its constexprs and the seconds between the two calls. A kernel whose variant is already in memory calls neither,
so a run after the warm-up that records nothing compiled nothing. Under TRITON_INTERPRET=1 nothing compiles and
nothing is recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Self


@dataclass
class Compile:
    kernel: str
    constants: str
    seconds: float


@dataclass
class CompileLog:
    """A context manager: the compiles (and on-disk cache loads) of Triton kernels while it is entered."""

    compiles: list[Compile] = field(default_factory=list)
    _started: dict[str, float] = field(default_factory=dict)
    _previous: tuple = ()

    def __enter__(self) -> Self:
        from triton import knobs

        rt = knobs.runtime
        self._previous = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        rt.jit_cache_hook, rt.jit_post_compile_hook = self._chain(self._before, 0), self._chain(self._after, 1)
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._previous

    def _chain(self, mine, which: int):
        def hook(**kwargs):
            mine(**kwargs)
            previous = self._previous[which]
            return previous(**kwargs) if previous is not None else None
        return hook

    def _before(self, *, key, fn, **_) -> None:
        self._started[f"{fn.name}|{key}"] = time.perf_counter()

    def _after(self, *, key, fn, compile, **_) -> None:
        t0 = self._started.pop(f"{fn.name}|{key}", None)
        names = getattr(getattr(fn, "jit_function", None), "arg_names", [])
        shown = []
        for path, value in (compile.get("constants") or {}).items():  # keyed by the argument's index path
            index = path[0] if isinstance(path, tuple) and path else path
            name = names[index] if isinstance(index, int) and index < len(names) else str(path)
            shown.append(f"{name}={value}")
        self.compiles.append(Compile(fn.name, ", ".join(shown), time.perf_counter() - t0 if t0 is not None else 0.0))

    def seconds(self) -> float:
        return sum(c.seconds for c in self.compiles)

    def describe(self, limit: int = 8) -> str:
        """One line: how many, how long, the slowest `limit` with their constexprs."""
        if not self.compiles:
            return "no Triton compiles"
        slow = sorted(self.compiles, key=lambda c: -c.seconds)[:limit]
        return (f"{len(self.compiles)} Triton compiles, {self.seconds():.3f} s: "
                + "; ".join(f"{c.kernel} {c.seconds * 1e3:.0f} ms ({c.constants})" for c in slow))
