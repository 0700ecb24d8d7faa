"""Registers the `ascend` backend. The probe never imports torch_npu or initialises CANN.

It reads what the driver publishes (/dev/davinci<N>), ASCEND_RT_VISIBLE_DEVICES, and whether a
torch_npu package can be found (importlib.util.find_spec locates it without running it). The
test-only CPU fake of torch_npu (tests/ascend/fake_torch_npu) carries a marker file next to its
package; only then does `emulation()` offer a stand-in, for `--device ascend` and `--device npu`.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from deepinfer.backend import BackendInfo, hookimpl

FAKE_MARKER = "deepinfer-test-fake.marker"


def _torch_npu_dir() -> str | None:
    spec = importlib.util.find_spec("torch_npu")  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


def _davinci_devices() -> list[str]:
    return [p for p in glob.glob("/dev/davinci*") if os.path.basename(p)[len("davinci"):].isdigit()]


def probe() -> list[str]:
    """Reasons the ascend backend cannot run here; [] when it can."""
    reasons: list[str] = []
    pkg = _torch_npu_dir()
    if pkg is None:
        reasons.append("torch_npu not importable (pip install -r requirements-ascend.txt, with CANN installed)")
    elif os.path.exists(os.path.join(os.path.dirname(pkg), FAKE_MARKER)):
        reasons.append(f"the torch_npu found is DeepInfer's test-only CPU fake ({pkg})")
    if os.environ.get("ASCEND_RT_VISIBLE_DEVICES", None) in ("", "-1"):
        reasons.append("ASCEND_RT_VISIBLE_DEVICES hides every NPU")
    elif not _davinci_devices():
        reasons.append("no /dev/davinci device (no Ascend NPU driver or device here)")
    return reasons


def emulation() -> str | None:
    """The stand-in `--device ascend` runs on without an NPU: the test-only fake torch_npu on CPU tensors."""
    pkg = _torch_npu_dir()
    if pkg is None or not os.path.exists(os.path.join(os.path.dirname(pkg), FAKE_MARKER)):
        return None
    return f"DeepInfer's test-only CPU fake of torch_npu ({pkg}); CPU tensors, no NPU"


@hookimpl
def deepinfer_register_backends(register) -> None:
    register(
        BackendInfo(
            name="ascend",
            backend_class="deepinfer.backends.ascend.backend:AscendBackend",
            probe=probe,
            device_type="npu",
            priority=10,
            description="torch_npu fused operators for Ascend NPUs (910B / A2, A3; written, never run on hardware)",
            emulation=emulation,
            emulates_device_type=True,  # `--device npu` over the fake too: it is only ever on a test's path
        )
    )
