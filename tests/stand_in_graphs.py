"""A stand-in graph API for tests on machines without one (tests/engine, tests/spec, tests/nvidia import it; the
tests/ folder is on sys.path through its conftest.py).

`StandInGraphRunner` is the contract's bucketed decode-graph runner (`DecodeGraphRunner`) over a graph API whose
"graph" is the captured function and its output buffer: a replay re-runs the function on the static inputs into
that buffer, which is what a captured device graph does. It counts replays per bucket. The padding, static buffers
and bucket choice under test are the contract's own code, not the stand-in's."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.backend import DecodeGraphRunner


@dataclass
class StandInGraphRunner(DecodeGraphRunner):
    def new_pool(self):
        return None

    def capture_one(self, fn, pool):
        out = fn()
        return {"fn": fn, "out": out, "replays": 0}, out

    def replay(self, graph):
        graph["out"].copy_(graph["fn"]())
        graph["replays"] += 1
