"""pluggy hook specifications: how a backend (built-in or third-party) makes itself known."""

from __future__ import annotations

from typing import Callable

import pluggy

from deepinfer.core.backend import BackendInfo

PROJECT = "deepinfer"
ENTRY_POINT_GROUP = "deepinfer.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class BackendHookSpecs:
    @hookspec
    def deepinfer_register_backends(self, register: Callable[[BackendInfo], None]) -> None:
        """Call register(BackendInfo(...)) for each backend this plugin provides.

        Runs at start-up only. Must not import a vendor runtime or touch a device:
        the probe does that check lazily and cheaply.
        """
