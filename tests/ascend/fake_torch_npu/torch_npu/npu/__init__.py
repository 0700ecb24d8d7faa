"""The fake `torch_npu.npu` (which the real package also installs as `torch.npu`): device services on
the host. There is no device: memory is the host's, synchronize does nothing, streams and events are inert
(the CPU runs everything in order), and an NPUGraph is the record-and-replay stand-in of torch_npu/_capture.py
(it re-runs the recorded ops on the CPU; it is not ACL's graph engine)."""

from __future__ import annotations

import contextlib
import os

import torch

from torch_npu._capture import STATE, TaskGroup, _Recorder

EVENTS: list[str] = []  # what the graph / stream emulation was asked to do, for tests


def is_available() -> bool:
    return False  # the fake runs on CPU tensors; the backend learns this from torch_npu.__deepinfer_fake__


def device_count() -> int:
    return 0


def get_device_name(device=None) -> str:
    return os.environ.get("FAKE_TORCH_NPU_SOC", "Ascend910B3")


def mem_get_info(device=None) -> tuple[int, int]:
    pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * size, os.sysconf("SC_PHYS_PAGES") * size


def synchronize(device=None) -> None:
    EVENTS.append("synchronize")


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)


class Stream:
    def wait_stream(self, other: Stream) -> None:
        EVENTS.append("wait_stream")

    def synchronize(self) -> None:
        EVENTS.append("stream.synchronize")


_CURRENT = Stream()


def current_stream(device=None) -> Stream:
    return _CURRENT


@contextlib.contextmanager
def stream(s: Stream):
    EVENTS.append("stream")
    yield


def graph_pool_handle() -> object:
    return object()


class ExternalEvent:
    """Orders the update stream before a replay on the device; on the CPU everything is already in order."""

    def record(self, stream=None) -> None:
        EVENTS.append("event.record")

    def wait(self, stream=None) -> None:
        EVENTS.append("event.wait")

    def reset(self, stream=None) -> None:
        EVENTS.append("event.reset")


class NPUGraph:
    def __init__(self) -> None:
        self.captured = False
        self.replays = 0
        self.nodes: list = []

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("NPUGraph.replay before capture")
        if STATE.recorder is not None or STATE.updating is not None:
            raise RuntimeError("NPUGraph.replay during a capture or a task update")
        for node in self.nodes:
            node.run()
        self.replays += 1
        EVENTS.append("replay")


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, pool=None, stream=None, capture_error_mode: str = "global"):
    if STATE.recorder is not None:
        raise RuntimeError("fake NPUGraph: nested capture")
    EVENTS.append("capture_begin")
    STATE.recorder = _Recorder(npu_graph)
    try:
        with STATE.recorder:
            yield
    finally:
        STATE.recorder, STATE.group = None, None
    npu_graph.captured = True
    EVENTS.append("capture_end")


def graph_task_group_begin(stream) -> None:
    if STATE.recorder is None or STATE.group is not None:
        raise RuntimeError("graph_task_group_begin: only inside a capture, not nested")
    STATE.group = TaskGroup()


def graph_task_group_end(stream) -> TaskGroup:
    if STATE.group is None:
        raise RuntimeError("graph_task_group_end without graph_task_group_begin")
    handle, STATE.group = STATE.group, None
    return handle


def graph_task_update_begin(stream, handle: TaskGroup) -> None:
    if STATE.recorder is not None or STATE.updating is not None or not isinstance(handle, TaskGroup):
        raise RuntimeError("graph_task_update_begin: outside capture, with a handle from graph_task_group_end")
    STATE.updating, STATE.update_index = handle, 0


def graph_task_update_end(stream) -> None:
    if STATE.updating is None or STATE.update_index != len(STATE.updating.nodes):
        raise RuntimeError("graph_task_update_end: every operator of the task group must be updated first")
    STATE.updating = None
