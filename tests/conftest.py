"""Project-wide pytest setup, kept minimal: an optional CPU thread cap, the `gpu` marker skip, and the one
random-weight checkpoint per preset that tests/engine, tests/kv and tests/parallel share.

Markers (`gpu`, `slow`) are declared in pyproject.toml. Area fixtures live in
their own tests/<area>/ directories.
"""

from __future__ import annotations

import os

# The NVIDIA backend's Triton kernels run on the CPU under the interpreter. TRITON_INTERPRET must be
# set before the first @triton.jit is defined, and any test (a backend listing, a coverage report)
# may import the kernels first, so it is decided here, before every other test module.
# nvidia-smi's device files tell whether a GPU is there without touching torch.cuda.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import envs  # noqa: E402

# DEEPINFER_TEST_THREADS caps torch's intra-op threads (useful when several suites share a few
# cores); unset, torch's default (one per physical core) stands.
if envs.TEST_THREADS.get() is not None:
    torch.set_num_threads(max(1, envs.TEST_THREADS.get()))


def pytest_collection_modifyitems(config, items):
    # torch.cuda.is_available() asks the driver for a device count; it creates no context.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset) -> directory of a random-weight checkpoint (seed 0), made once per session."""
    from deepinfer.checkpoints import make_checkpoint

    made: dict[str, str] = {}

    def get(preset: str) -> str:
        if preset not in made:
            d = tmp_path_factory.mktemp(preset.replace("-", "_"))
            make_checkpoint(preset, str(d), seed=0)
            made[preset] = str(d)
        return made[preset]

    return get
