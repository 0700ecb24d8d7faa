"""Backend registry: discovers plugins once, probes them, and resolves `--device`."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType

import pluggy

from deepinfer import envs
from deepinfer.backend.base import Backend
from deepinfer.backend.hookspecs import ENTRY_POINT_GROUP, PROJECT, BackendHookSpecs, BackendInfo
from deepinfer.errors import BackendError

DEVICE_TYPES = ("cpu", "cuda", "npu")
logger = logging.getLogger("deepinfer")


@dataclass
class ProbedBackend:
    info: BackendInfo
    reasons: list[str]  # why it is unavailable here; empty = available
    emulation: str | None = None  # unavailable, but runs on this stand-in when named explicitly

    @property
    def available(self) -> bool:
        return not self.reasons

    def state(self) -> str:
        """"available", or "unavailable: <reasons>" plus the stand-in an explicit name would run on."""
        if self.available:
            return "available"
        state = "unavailable: " + "; ".join(self.reasons)
        if self.emulation:
            state += f"; runs emulated when named: {self.emulation}"
        return state


class BackendRegistry:
    """All registered backends. Built once; no pluggy call happens after start-up."""

    def __init__(self, extra_plugins: list[object] | None = None, load_entry_points: bool = True):
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(BackendHookSpecs)
        if load_entry_points:
            self._pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        for plugin in extra_plugins or []:
            self._pm.register(plugin)
        self._infos: dict[str, BackendInfo] = {}
        self._pm.hook.deepinfer_register_backends(register=self._register)
        self._probed: dict[str, ProbedBackend] = {}

    def _register(self, info: BackendInfo) -> None:
        if info.name in self._infos:
            raise BackendError(f"backend {info.name!r} is registered twice")
        if info.name in ("auto",):
            raise BackendError("'auto' is reserved and cannot name a backend")
        self._infos[info.name] = info

    def names(self) -> list[str]:
        return sorted(self._infos)

    def probe(self, name: str) -> ProbedBackend:
        if name not in self._probed:
            info = self._infos[name]
            try:
                reasons = list(info.probe())
            except Exception as exc:  # a broken probe makes its backend unavailable, not the engine
                reasons = [f"probe failed: {type(exc).__name__}: {exc}"]
            emulation = None
            if reasons and info.emulation is not None:
                try:
                    emulation = info.emulation() or None
                except Exception as exc:  # a broken emulation hook means no stand-in
                    reasons.append(f"emulation check failed: {type(exc).__name__}: {exc}")
            self._probed[name] = ProbedBackend(info, reasons, emulation)
        return self._probed[name]

    def probe_all(self) -> list[ProbedBackend]:
        return [self.probe(n) for n in self.names()]

    def _describe(self) -> str:
        lines = []
        for p in self.probe_all():
            lines.append(f"  {p.info.name} (device {p.info.device_type}): {p.state()}")
        return "\n".join(lines) or "  (no backends registered)"

    def resolve(self, device: str) -> BackendInfo:
        """Map auto | cpu | cuda | npu | <backend name> to one available backend, or explain why not.

        A backend named exactly that is unavailable but offers a stand-in (BackendInfo.emulation, e.g.
        the nvidia kernels under the Triton interpreter) resolves to it, with a warning; `auto` only ever
        picks backends that are really available, and a device type too unless none is and a backend
        of that type declares `emulates_device_type` and offers its stand-in.
        """
        device = (device or "auto").strip().lower()
        if device in self._infos:
            probed = self.probe(device)
            if not probed.available and probed.emulation:
                logger.warning(
                    "backend %r is unavailable here (%s); running it emulated: %s",
                    device, "; ".join(probed.reasons), probed.emulation,
                )
                return probed.info
            candidates = [probed.info]
        elif device == "auto":
            candidates = list(self._infos.values())
        elif device in DEVICE_TYPES:
            candidates = [i for i in self._infos.values() if i.device_type == device]
        else:
            raise BackendError(
                f"unknown device {device!r}: choose auto, {', '.join(DEVICE_TYPES)} or a backend name.\n"
                f"Registered backends:\n{self._describe()}"
            )
        available = [i for i in candidates if self.probe(i.name).available]
        if not available and device in DEVICE_TYPES:
            stand_ins = [i for i in candidates if i.emulates_device_type and self.probe(i.name).emulation]
            if stand_ins:
                chosen = max(stand_ins, key=lambda i: (i.priority, i.name))
                probed = self.probe(chosen.name)
                logger.warning("no %s backend is available here; running %r emulated: %s", device, chosen.name,
                               probed.emulation)
                return chosen
        if not available:
            raise BackendError(f"no available backend for device {device!r}.\nRegistered backends:\n{self._describe()}")
        return max(available, key=lambda i: (i.priority, i.name))

    def create(self, device: str, **kwargs) -> Backend:
        info = self.resolve(device)
        cls = load_backend_class(info)
        return cls(**kwargs)


def load_backend_class(info: BackendInfo) -> type[Backend]:
    module_name, _, attr = info.backend_class.partition(":")
    try:
        module: ModuleType = importlib.import_module(module_name)
        cls = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise BackendError(f"backend {info.name!r}: cannot load {info.backend_class}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendError(f"backend {info.name!r}: {info.backend_class} is not a deepinfer Backend subclass")
    return cls


_default: BackendRegistry | None = None


def default_registry() -> BackendRegistry:
    """The process-wide registry from installed entry points (built once)."""
    global _default
    if _default is None:
        _default = BackendRegistry()
    return _default


def requested_device(explicit: str | None) -> str:
    """EngineConfig.device / --device win over DEEPINFER_DEVICE; default auto."""
    return explicit or envs.DEVICE.get() or "auto"
