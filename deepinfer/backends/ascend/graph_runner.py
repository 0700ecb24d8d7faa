"""Decode-step NPU graphs (ACL graphs): the contract's bucketed `DecodeGraphRunner` on torch.npu's graph
API (`NPUGraph`, `graph(...)`, `graph_pool_handle()`), plus the per-replay update of the fused
attention's host sequence lengths (graph_tasks.py). Written to the documented API, never run on an NPU.

Each bucket is warmed up twice on a side stream, then captured with a `graph_tasks.recording` open, so
every MLA layer's npu_fused_infer_attention_score becomes an updatable task. `run` loads the static
inputs (the contract's StaticInputs), re-issues each task with this step's `seq_lens_cpu` (0 for the
padded rows) and replays. Graphs are refused (`eager_reason`, every batch runs eagerly) when a layer
of the model runs a native op whose host-side lengths a capture would freeze (the backend says which).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from deepinfer.backend import DecodeGraphRunner, ForwardBatch
from deepinfer.backends.ascend import graph_tasks


def _torch_npu() -> ModuleType:
    """torch_npu (its .npu is the module torch_npu also installs as torch.npu); imported only when capturing."""
    return importlib.import_module("torch_npu")


@dataclass
class NPUGraphRunner(DecodeGraphRunner):
    eager_reason: str = ""  # non-empty: no graphs were captured and every batch runs eagerly
    tasks: dict[int, list[graph_tasks.FIATask]] = field(default_factory=dict)
    update_stream: object = None

    @property
    def npu(self) -> ModuleType:
        return _torch_npu().npu

    def new_pool(self) -> object:
        return self.npu.graph_pool_handle()

    def capture_one(self, fn: Callable[[], torch.Tensor], pool: object) -> tuple[object, torch.Tensor]:
        npu = self.npu
        stream = npu.Stream()
        stream.wait_stream(npu.current_stream())
        with npu.stream(stream):
            for _ in range(2):  # warm-up: operator compilation and the allocator settle before capture
                fn()
        npu.current_stream().wait_stream(stream)
        graph = npu.NPUGraph()
        with graph_tasks.recording(_torch_npu()) as rec, npu.graph(graph, pool=pool):
            out = fn()
        return (graph, rec.tasks), out

    def replay(self, graph: object) -> None:
        graph[0].replay()

    def finish_capture(self) -> None:
        self.npu.synchronize()

    def can_run(self, batch: ForwardBatch) -> bool:
        return not self.eager_reason and super().can_run(batch)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        size = self.bucket_for(batch.num_seqs)
        self.static.load(batch, size, self.group_names)
        graph, tasks = self.graphs[size]
        if tasks:
            if self.update_stream is None:
                self.update_stream = self.npu.Stream()
            lens = [int(n) for n in batch.seq_lens_cpu] + [0] * (size - batch.num_seqs)
            graph_tasks.update_tasks(_torch_npu(), self.update_stream, tasks, lens)
        self.replay((graph, tasks))
        return self.outputs[size][: batch.num_seqs]

    @classmethod
    def refusing(cls, model, caches, block_size: int, reason: str) -> "NPUGraphRunner":
        """A runner that captures nothing and sends every batch to the eager path, saying why."""
        return cls(model=model, caches=caches, block_size=block_size, max_blocks_per_seq=0, buckets=[],
                   group_names=sorted(caches.specs), eager_reason=reason)
