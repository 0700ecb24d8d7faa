"""Builds and loads the CUDA C++ kernels of csrc/cuda on first use (torch.utils.cpp_extension).

Compiled for sm_90 and, where this nvcc knows it, sm_100; cached in
$DEEPINFER_CACHE_DIR/torch_extensions (default ~/.cache/deepinfer) keyed by the
sources, so later starts only load the shared object.

A process killed while cpp_extension builds or loads (a timeout, Ctrl-C, an OOM kill) leaves its lock file behind,
and every later start then waits on it forever without a word (torch's FileBaton polls for the file to go; on an
H100, 2026-12-06 session 31, after a test run was killed while its first NvidiaBackend MoE op built them, the
next two runs printed nothing and left the GPU idle for their whole 240-300 s: most likely this, not confirmed, as
they said nothing). So the build runs under `build_lock`: an OS lock the kernel drops when its holder dies, taken
before cpp_extension's; holding it, no live deepinfer process is inside the build, so a `lock` file there is stale
and is removed, with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.errors import BackendError

_SOURCES = ("bindings.cpp", "moe_kernels.cu", "int4_gemv.cu")
logger = logging.getLogger(__name__)


def _packaged_csrc() -> Path | None:
    """deepinfer/_csrc/cuda of a wheel install (setup.py maps the repo's csrc/ there), as a real directory."""
    res = resources.files("deepinfer").joinpath("_csrc", "cuda")
    return res if isinstance(res, Path) else None  # cpp_extension compiles files on disk, not in a zip


def _checkout_csrc() -> Path:
    """csrc/cuda of the source checkout the deepinfer package is imported from (editable install, PYTHONPATH)."""
    package_dir = Path(__file__).resolve().parents[2]  # <checkout>/deepinfer/backends/nvidia/cuda_ext.py
    return package_dir.parent / "csrc" / "cuda"


def csrc_dir() -> Path:
    """The directory holding the CUDA C++ sources: the packaged copy first, else the repo checkout."""
    looked = []
    for where in (_packaged_csrc(), _checkout_csrc()):
        if where is None:
            continue
        if all((where / s).is_file() for s in _SOURCES):
            return where
        looked.append(str(where))
    raise BackendError(
        f"CUDA C++ sources ({', '.join(_SOURCES)}) not found; looked in: {', '.join(looked)}. A wheel ships them "
        "as deepinfer/_csrc/cuda and a source checkout has them in csrc/cuda: reinstall deepinfer, or run "
        "without them (DEEPINFER_NVIDIA_CUDA_EXT=0)"
    )


def compiler_available() -> bool:
    """Whether nvcc can be found (no build is attempted)."""
    try:
        _nvcc()
    except BackendError:
        return False
    return True


def _nvcc() -> str:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        raise BackendError(
            "the nvidia backend's CUDA C++ kernels need a CUDA compiler (nvcc) and none was found: install the "
            "CUDA toolkit matching torch's CUDA, set CUDA_HOME, or run without them (DEEPINFER_NVIDIA_CUDA_EXT=0)"
        )
    return nvcc


def gencode_flags(nvcc: str) -> list[str]:
    """sm_90 always; sm_100 when this nvcc lists it."""
    try:
        archs = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        archs = []
    flags = ["-gencode=arch=compute_90,code=sm_90"]
    if "compute_100" in archs:
        flags.append("-gencode=arch=compute_100,code=sm_100")
    return flags


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold the build directory's OS lock (flock on `deepinfer_build.flock`, released when the file closes or the
    process dies) and remove a `lock` file cpp_extension's FileBaton left behind (see the module docstring). Waits,
    saying so, while another process holds it (that one is building or loading: it will finish)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "deepinfer_build.flock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's build of the CUDA C++ kernels in %s", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build of the CUDA C++ kernels that was killed before it finished "
                           "(torch's cpp_extension would wait on it forever)", stale)
            stale.unlink(missing_ok=True)
        yield


@functools.lru_cache(maxsize=1)
def load():
    """The compiled extension module (built once per source version, then cached)."""
    if torch.version.cuda is None:
        raise BackendError(f"torch {torch.__version__} has no CUDA; the CUDA C++ kernels cannot be built")
    nvcc = _nvcc()
    from torch.utils import cpp_extension

    src = csrc_dir()
    cache = Path(envs.CACHE_DIR.get()).expanduser() / "torch_extensions"
    cache.mkdir(parents=True, exist_ok=True)
    try:
        with build_lock(cache):
            return cpp_extension.load(
                name="deepinfer_cuda_ext",
                sources=[str(src / s) for s in _SOURCES],
                extra_include_paths=[str(src)],
                extra_cflags=["-O3", "-std=c++17"],
                extra_cuda_cflags=["-O3", "-std=c++17", *gencode_flags(nvcc)],
                build_directory=str(cache),
                verbose=envs.VERBOSE_BUILD.get(),
            )
    except Exception as exc:  # compiler output is in the message
        raise BackendError(f"building the CUDA C++ kernels (csrc/cuda) failed: {exc}") from exc


def grouped_topk(ext, router_logits: torch.Tensor, spec, correction_bias: torch.Tensor | None):
    """The CUDA C++ router: same contract as Backend.route for softmax/sigmoid routers."""
    from deepinfer.backends.nvidia.moe_routing import GROUPING_CODES, SCORING_CODES

    grouping = GROUPING_CODES[spec.topk_method]
    w, ids = ext.grouped_topk(router_logits, correction_bias, spec.top_k, spec.n_group if grouping else 1,
                              spec.topk_group if grouping else 1, SCORING_CODES[spec.scoring_func], grouping,
                              bool(spec.norm_topk_prob), float(spec.routed_scaling_factor))
    return w, ids


def make_align(ext):
    """moe_align with the Triton path's signature, backed by the CUDA C++ kernel."""

    def align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
        sorted_ids, expert_ids, total = ext.moe_align(topk_ids, num_experts, block_m)
        return sorted_ids, expert_ids, total

    return align
