"""Decode-step CUDA graphs: the contract's bucketed `DecodeGraphRunner` on torch.cuda's graph API.

Each bucket is warmed up twice on a side stream (Triton compiles, the allocator settles), then
captured into a `torch.cuda.CUDAGraph` that shares one memory pool with the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.backend import DecodeGraphRunner, default_buckets

__all__ = ["CUDAGraphRunner", "default_buckets"]


@dataclass
class CUDAGraphRunner(DecodeGraphRunner):
    """Replays captured CUDA graphs; `can_run` / `run` is what ModelRunner asks of it."""

    def new_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def capture_one(self, fn: Callable[[], torch.Tensor], pool: object) -> tuple[object, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton compiles, allocator settles
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    def replay(self, graph: object) -> None:
        graph.replay()

    def finish_capture(self) -> None:
        torch.cuda.synchronize()
