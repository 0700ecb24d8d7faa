"""Decode-step NPU graphs (ACL graphs): the contract's bucketed `DecodeGraphRunner` on torch.npu's graph
API (`NPUGraph`, `graph(...)`, `graph_pool_handle()`), written to the documented API, never run on an NPU.

Not switched on (caps.graph_capture is False): the MLA op passes actual_seq_lengths_kv to
npu_fused_infer_attention_score as host integers, which a capture would freeze; replaying correctly
needs them updated per step (torch.npu.graph_task_update_begin / _end), which is not wired yet.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer.backend import DecodeGraphRunner


def _npu() -> ModuleType:
    """torch_npu.npu, the module torch_npu also installs as torch.npu (imported only when capturing)."""
    return importlib.import_module("torch_npu").npu


@dataclass
class NPUGraphRunner(DecodeGraphRunner):
    @property
    def npu(self) -> ModuleType:
        return _npu()

    def new_pool(self) -> object:
        return self.npu.graph_pool_handle()

    def capture_one(self, fn: Callable[[], torch.Tensor], pool: object) -> tuple[object, torch.Tensor]:
        stream = self.npu.Stream()
        stream.wait_stream(self.npu.current_stream())
        with self.npu.stream(stream):
            for _ in range(2):  # warm-up: operator compilation and the allocator settle before capture
                fn()
        self.npu.current_stream().wait_stream(stream)
        graph = self.npu.NPUGraph()
        with self.npu.graph(graph, pool=pool):
            out = fn()
        return graph, out

    def replay(self, graph: object) -> None:
        graph.replay()

    def finish_capture(self) -> None:
        self.npu.synchronize()
