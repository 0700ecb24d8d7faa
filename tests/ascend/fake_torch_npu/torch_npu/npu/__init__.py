"""The fake `torch_npu.npu` (which the real package also installs as `torch.npu`): device services on
the host. There is no device: memory is the host's, synchronize does nothing, streams are inert, and an
NPUGraph records that it was captured and replayed (it cannot re-run kernels; the tests check the calls)."""

from __future__ import annotations

import contextlib
import os

import torch

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


class NPUGraph:
    def __init__(self) -> None:
        self.captured = False
        self.replays = 0

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("NPUGraph.replay before capture")
        self.replays += 1
        EVENTS.append("replay")


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, pool=None, stream=None, capture_error_mode: str = "global"):
    EVENTS.append("capture_begin")
    yield
    npu_graph.captured = True
    EVENTS.append("capture_end")
