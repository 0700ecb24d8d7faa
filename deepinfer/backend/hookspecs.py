"""Registration: the pluggy hook through which a backend (built-in or third-party) makes itself
known, and `BackendInfo`, what it registers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pluggy

PROJECT = "deepinfer"
ENTRY_POINT_GROUP = "deepinfer.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass
class BackendInfo:
    """What a plugin registers: a name, a probe that never initialises a device runtime, and a lazy class path.

    probe() returns the reasons the backend cannot run here ([] = available). emulation(), when
    given, returns a description of a stand-in it can run on instead (the nvidia backend's
    kernels under the Triton interpreter on the CPU) or None; a stand-in is used when the
    backend is named explicitly (`--device nvidia`), never for `auto`, and for its device type
    (`--device npu`) only when `emulates_device_type` says so and nothing real is available:
    the ascend backend's stand-in is a test-only fake that exists only on a test's path, so
    asking for `npu` there means asking for it.
    """

    name: str
    backend_class: str  # "package.module:ClassName", imported only when selected
    probe: Callable[[], list[str]]
    device_type: str = "cpu"  # what --device value (besides the name) selects it: cpu | cuda | npu
    priority: int = 0  # `auto` takes the available backend with the highest priority
    description: str = ""
    emulation: Callable[[], str | None] | None = None
    emulates_device_type: bool = False
    plugin: str = field(default="", compare=False)


class BackendHookSpecs:
    @hookspec
    def deepinfer_register_backends(self, register: Callable[[BackendInfo], None]) -> None:
        """Call register(BackendInfo(...)) for each backend this plugin provides.

        Runs at start-up only. Must not import a vendor runtime or touch a device:
        the probe does that check lazily and cheaply.
        """
