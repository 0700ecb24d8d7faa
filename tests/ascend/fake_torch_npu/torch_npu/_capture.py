"""TEST-ONLY CPU stand-in for ACL graph capture (torch.npu.NPUGraph) and its per-replay task updates.

Not a graph compiler. While `torch.npu.graph(g)` is open, every aten op the caller runs is recorded
(a TorchDispatchMode) with the tensors it read and wrote, and every fake torch_npu operator is recorded as
ONE node with the Python arguments it was called with, host integers included: what the real capture
freezes. `NPUGraph.replay()` re-runs the nodes in order on the same tensors (outputs are copied back into
the captured output tensors, so later nodes read them), so a replay sees the static inputs' current
contents but the host arguments of capture time, as on the device.

The documented update protocol (torch_npu.npu.graph_task_group_begin / _end at capture, then
graph_task_update_begin(stream, handle) + the same operator + graph_task_update_end before a replay)
replaces the recorded arguments of the task group's operator node: the next replays use them.

Like the real capture, it refuses what a graph cannot hold: reading a device value on the host
(.item(), bool(), .tolist(), nonzero, boolean-mask indexing) outside a fake operator's own body.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten
HOST_SYNC = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default,
             aten.equal.default, aten.masked_select.default, aten._unique2.default}


@dataclass
class OpNode:
    """A fake torch_npu operator call: re-run with its (possibly updated) arguments at replay."""

    fn: object
    args: tuple
    kwargs: dict
    out: object

    def run(self) -> None:
        _copy_back(self.out, self.fn(*self.args, **self.kwargs), self.args, self.kwargs)


@dataclass
class AtenNode:
    """An aten op; `fresh` marks the outputs it allocated at capture (others alias an input: views and
    in-place results, which re-running already wrote through; decided from storage, since schemas such
    as contiguous() may or may not alias)."""

    func: object
    args: tuple
    kwargs: dict
    out: object
    fresh: list[bool]

    def run(self) -> None:
        new = self.func(*self.args, **self.kwargs)
        for o, n, f in zip(_tensors(self.out), _tensors(new), self.fresh):
            if f and o.numel():
                o.copy_(n)


def _storages(obj) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in _tensors(obj) if t.numel()}


@dataclass
class TaskGroup:
    """The handle graph_task_group_end returns: the operator nodes recorded inside the group."""

    nodes: list[OpNode] = field(default_factory=list)


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _copy_back(old, new, args, kwargs) -> None:
    inputs = {id(t) for t in _tensors(args) + _tensors(kwargs)}
    for o, n in zip(_tensors(old), _tensors(new)):
        if id(o) not in inputs and o is not n and o.numel():  # in-place results are the inputs themselves
            o.copy_(n)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "NPUGraph"):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_SYNC:
            raise RuntimeError(f"fake NPUGraph: {func} reads a device value on the host during capture "
                               "(a captured graph cannot)")
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            if any(t is not None and t.dtype == torch.bool for t in args[1]):
                raise RuntimeError("fake NPUGraph: boolean-mask indexing has a data-dependent shape; "
                                   "a captured graph cannot hold it")
        out = func(*args, **kwargs)
        inputs = _storages(args) | _storages(kwargs)
        fresh = [t.untyped_storage().data_ptr() not in inputs for t in _tensors(out)]
        self.graph.nodes.append(AtenNode(func, args, kwargs, out, fresh))
        return out


class _State:
    recorder: _Recorder | None = None  # the capture in progress
    group: TaskGroup | None = None  # the task group open in it
    updating: TaskGroup | None = None  # graph_task_update_begin's handle
    update_index: int = 0


STATE = _State()
CALLS: collections.Counter[str] = collections.Counter()  # operator name -> calls (eager or captured): for tests


def recorded(fn):
    """Wrap a fake operator: one node while capturing, an argument update while updating, else a call."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if STATE.updating is not None:
            nodes = STATE.updating.nodes
            if STATE.update_index >= len(nodes) or nodes[STATE.update_index].fn is not call:
                raise RuntimeError(f"graph_task_update: {fn.__name__} is not the next operator of the task group")
            node = nodes[STATE.update_index]
            node.args, node.kwargs = args, kwargs
            STATE.update_index += 1
            return node.out
        CALLS[fn.__name__] += 1
        if STATE.recorder is None:
            return fn(*args, **kwargs)
        with _disable_current_modes():  # the operator is one kernel: its body is not recorded
            out = fn(*args, **kwargs)
        node = OpNode(call, args, kwargs, out)
        STATE.recorder.graph.nodes.append(node)
        if STATE.group is not None:
            STATE.group.nodes.append(node)
        return out

    return call
