"""Every environment variable DeepInfer reads, declared once: name, type, default and meaning.

    from deepinfer import envs
    if envs.BATCH_INVARIANT.get(): ...

`EnvVar.get()` reads the environment when it is called, never at import: benchmarks flip some
variables between runs, and a value a caller wants fixed for the process it caches itself
(mla_decode_params.env_overrides does). A bad value raises the variable's error class naming the
variable and the values it accepts: ConfigError, or BackendError for the NVIDIA tuning integers
(which always raised it). An empty or blank value counts as unset.

Nothing else in deepinfer/ or benchmarks/ reads these from os.environ (tests/test_envs.py checks
it), and the README's configuration tables are `python -m deepinfer.envs --markdown` (checked by the
same test).

Standard library and deepinfer.errors only, so it imports from anywhere, backends included.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer.errors import BackendError, ConfigError, DeepInferError

KINDS = ("bool", "int", "str")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# Table sections, in README order.
GROUPS: dict[str, str] = {
    "engine": "Engine settings (`EngineConfig.with_env`; an explicit `EngineConfig` field or CLI flag wins)",
    "server": "Server",
    "nvidia": "NVIDIA backend: build and tuning (A/B runs, sweeps)",
    "cpu": "CPU backend: threads and fast paths (docs/performance.md, \"CPU threads\")",
    "dev": "Tests, CI and benchmarks",
    "vendor": "Read from other projects",
}


@dataclass(frozen=True)
class EnvVar:
    """One environment variable. `default` is what get() gives when the variable is unset or blank
    (None: "not given", the reader decides); `default_text` says in the table what that means."""

    name: str
    kind: str  # "bool" | "int" | "str"
    default: Any
    meaning: str
    group: str
    minimum: int | None = None  # int: smallest accepted value
    maximum: int | None = None  # int: largest accepted value
    choices: tuple[Any, ...] | None = None  # the only accepted values (parsed: ints for kind "int")
    check: Callable[[Any], str | None] | None = None  # extra check of a parsed value: the problem, or None
    accepts_text: str | None = None  # the accepted values in words (error messages), where no rule above says it
    default_text: str | None = None  # the table's default column, where `default` alone does not say it
    empty_is_error: bool = False  # a set but blank value is an error instead of "unset"
    error: type[DeepInferError] = ConfigError

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.group not in GROUPS:
            raise ValueError(f"{self.name}: group {self.group!r} is not one of {tuple(GROUPS)}")

    # ------------------------------------------------------------ reading

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value as set, unparsed (None when unset)."""
        return (os.environ if environ is None else environ).get(self.name)

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Set to something other than blank."""
        raw = self.raw(environ)
        return raw is not None and raw.strip() != ""

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value, read now from `environ` (default os.environ); `default` when unset or blank."""
        raw = self.raw(environ)
        if raw is None or not raw.strip():
            if raw is not None and self.empty_is_error:
                raise self.error(f"{self.name} is empty: set {self.accepts()}")
            return self.default
        value = self._parse(raw)
        if self.choices is not None and value not in self.choices:
            raise self.error(f"{self.name}={raw!r} must be {self.accepts()}")
        if self.kind == "int":
            low, high = self.minimum, self.maximum
            if (low is not None and value < low) or (high is not None and value > high):
                if high is None:
                    raise self.error(f"{self.name}={raw!r} must be >= {low}")
                raise self.error(f"{self.name}={raw!r} must be {self._range()}")
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise self.error(f"{self.name}={raw!r} {problem}")
        return value

    def _parse(self, raw: str) -> Any:
        if self.kind == "bool":
            value = raw.strip().lower()
            if value in _TRUE:
                return True
            if value in _FALSE:
                return False
            raise self.error(f"{self.name}={raw!r} is not a boolean: use {self.accepts()}")
        if self.kind == "int":
            try:
                return int(raw.strip())
            except ValueError:
                raise self.error(f"{self.name}={raw!r} is not an integer: use {self.accepts()}") from None
        return raw

    def _range(self) -> str:
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            return f"an integer in [{low}, {high}]"
        if low is not None:
            return f"an integer >= {low}"
        if high is not None:
            return f"an integer <= {high}"
        return "an integer"

    def accepts(self) -> str:
        """The accepted values, in words."""
        if self.accepts_text:
            return self.accepts_text
        if self.choices is not None:
            names = [str(c) for c in self.choices]
            return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        if self.kind == "bool":
            return "0 or 1 (also false/true, no/yes, off/on)"
        if self.kind == "int":
            return self._range()
        return "any string"

    # ------------------------------------------------------------ documentation

    def default_cell(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if self.default is None:
            return "unset"
        if self.kind == "bool":
            return "`1`" if self.default else "`0`"
        return f"`{self.default}`"


def _power_of_two(value: int) -> str | None:
    return "must be a power of two >= 16" if value & (value - 1) else None


# ---------------------------------------------------------------- engine

DEVICE = EnvVar(
    "DEEPINFER_DEVICE", "str", None,
    "backend / device when `EngineConfig.device` / `--device` is not given: `auto`, `cpu`, `cuda`, `npu` or a "
    "backend name (blank is an error)",
    "engine", default_text="`auto`", accepts_text="auto, cpu, cuda, npu or a backend name", empty_is_error=True,
)
BATCH_INVARIANT = EnvVar(
    "DEEPINFER_BATCH_INVARIANT", "bool", False,
    "`1`: ask for batch-invariant results; a backend that cannot give them refuses at start-up",
    "engine",
)
ENABLE_MTP_VARLEN = EnvVar(
    "DEEPINFER_ENABLE_MTP_VARLEN", "bool", False,
    "`1`: speculative decoding with the checkpoint's MTP module (`EngineConfig.speculative_method=\"mtp\"`, "
    "docs/speculative.md)",
    "engine",
)
USE_NEXTN_DECODE = EnvVar(
    "DEEPINFER_USE_NEXTN_DECODE", "int", 0,
    "`N` > 0: MTP speculative decoding verifying at most N drafted tokens per step "
    "(`EngineConfig.num_speculative_tokens`; default 5 when speculation is on)",
    "engine", minimum=0,
)
ASYNC_SCHEDULING = EnvVar(
    "DEEPINFER_ASYNC_SCHEDULING", "bool", None,
    "`0` / `1`: schedule step N+1 while the device runs step N, when `EngineConfig.async_scheduling` is None",
    "engine", default_text="auto: on with an accelerator, off on the CPU",
)
DECODE_ROWS_MAX_TOKENS = EnvVar(
    "DEEPINFER_DECODE_ROWS_MAX_TOKENS", "int", 64,
    "a step with prompt chunks (a prefix hit's suffix, a short prompt) of at most this many tokens in all "
    "replays the decode graphs as one decode row per token where a captured bucket (max_num_seqs rows) covers it "
    "(worker/decode_rows.py); `0`: such steps run eagerly",
    "engine", minimum=0, maximum=1024,
)
SPEC_ONE_SYNC = EnvVar(
    "DEEPINFER_SPEC_ONE_SYNC", "bool", True,
    "`0`: speculative steps verify on the host and read the device back twice (the draw, then the drafts); `1`: "
    "where the MTP drafter replays graphs, a step of decodes and verify rows verifies, runs the MTP pass and the "
    "chain on the device and reads back once (spec/one_sync.py); the output is the same either way",
    "engine",
)

SPEC_OVERLAP_OUTPUT = EnvVar(
    "DEEPINFER_SPEC_OVERLAP_OUTPUT", "bool", True,
    "`1`: a one-sync speculative step's read-back is the next engine call's, so the host makes the step's text "
    "(detokenizer, logprobs' text) and the engine its outputs while the device runs the next step; outputs come "
    "one call after their step's launch, the same as with `0` (spec/overlap.py)",
    "engine",
)

SPEC_ASYNC_PAUSES = EnvVar(
    "DEEPINFER_SPEC_ASYNC_PAUSES", "bool", None,
    "`0` / `1`: an adaptive MTP engine (`--speculative-adaptive`) runs the plain steps of its drafting pauses "
    "through async scheduling (spec/async_pauses.py); `1` also on the CPU; an adaptive engine that cannot (n-gram "
    "drafts, a model with per-sequence state, `async_scheduling=False`) refuses `1` at start-up; engines without "
    "pauses (static k, speculation off) ignore it",
    "engine", default_text="auto: on where async scheduling is on by default (an accelerator), off on the CPU",
)

# ---------------------------------------------------------------- server

API_KEY = EnvVar(
    "DEEPINFER_API_KEY", "str", None,
    "bearer token the server requires on `/v1/*` when `--api-key` is not given",
    "server", default_text="unset: no auth",
)

# ---------------------------------------------------------------- NVIDIA backend
# Where unset means "the backend's tuned default", `default` is None and the backend keeps the constant
# (with its measurements); default_text shows it, and tests/test_envs.py checks the two agree.

CACHE_DIR = EnvVar(
    "DEEPINFER_CACHE_DIR", "str", "~/.cache/deepinfer",
    "where the compiled CUDA C++ extension is cached (in `torch_extensions/` under it)",
    "nvidia",
)
VERBOSE_BUILD = EnvVar(
    "DEEPINFER_VERBOSE_BUILD", "bool", False,
    "`1`: show the compiler output of the CUDA C++ extension's build",
    "nvidia",
)
NVIDIA_CUDA_EXT = EnvVar(
    "DEEPINFER_NVIDIA_CUDA_EXT", "bool", None,
    "`0` / `1`: force the CUDA C++ routing / alignment kernels off / on",
    "nvidia", default_text="auto: on where nvcc is found and the device is a GPU",
)
ROUTER_GEMV = EnvVar(
    "DEEPINFER_ROUTER_GEMV", "str", None,
    "router-logits GEMV tile: `BLOCK_E,BLOCK_D,num_warps` (the per-token GEMV, then at every size) or "
    "`BLOCK_T,BLOCK_E,BLOCK_D,num_warps[,num_stages]` (the token-tiled GEMV, 2..512 tokens)",
    "nvidia", default_text="per-size pick",
)
ROUTER_GEMV_MAX_TOKENS = EnvVar(
    "DEEPINFER_ROUTER_GEMV_MAX_TOKENS", "int", None,
    "most tokens whose router logits take the GEMV kernels; `0` sends every size to cuBLAS",
    "nvidia", default_text="`512` for gates of <= 64 x 2048 (V2-Lite), else `64`", error=BackendError,
)
MOE_FUSED_ROUTER = EnvVar(
    "DEEPINFER_MOE_FUSED_ROUTER", "bool", True,
    "`0`: no fused router GEMV + top-k (`gate_route`); the GEMV, then the top-k kernel",
    "nvidia",
)
MOE_FUSED_ROUTER_MAX_TOKENS = EnvVar(
    "DEEPINFER_MOE_FUSED_ROUTER_MAX_TOKENS", "int", None,
    "largest batch routed by the fused router GEMV + top-k kernel",
    "nvidia", minimum=0, maximum=64, default_text="`16`", error=BackendError,
)
MOE_DIRECT_MAX_PAIRS = EnvVar(
    "DEEPINFER_MOE_DIRECT_MAX_PAIRS", "int", None,
    "largest tokens x top_k run in the direct MoE schedule; `0` turns it off",
    "nvidia", default_text="`64`", error=BackendError,
)
MOE_DIRECT_TILE = EnvVar(
    "DEEPINFER_MOE_DIRECT_TILE", "str", None,
    "direct-mode MoE GEMM tile `BLOCK_N,BLOCK_K,num_warps,num_stages` (BLOCK_N counts gate + up rows)",
    "nvidia", default_text="`64,128,4,4`",
)
MOE_TILE = EnvVar(
    "DEEPINFER_MOE_TILE", "str", None,
    "aligned-mode MoE GEMM tile `BLOCK_N,BLOCK_K,num_warps,num_stages`",
    "nvidia", default_text="per-BLOCK_M pick",
)
MOE_W8A8_SWAP_AB = EnvVar(
    "DEEPINFER_MOE_W8A8_SWAP_AB", "bool", None,
    "fp8 W8A8 MoE GEMMs: `1` runs each product as weight x activations^T (the weight rows fill the fp8 MMA's M), "
    "`0` as activations x weight^T",
    "nvidia", default_text="per BLOCK_M, as measured",
)
INT4_GEMV = EnvVar(
    "DEEPINFER_INT4_GEMV", "bool", False,
    "`1`: int4 weights at one token (dense linears with contiguous groups, and the direct MoE GEMMs) run GEMV "
    "mainloops instead of a 16-row MMA tile (off: slower than the MMA tile on the H200's dense shapes)",
    "nvidia",
)
INT4_CUDA_GEMV = EnvVar(
    "DEEPINFER_INT4_CUDA_GEMV", "bool", None,
    "`0` / `1`: int4 weights (group 128, contiguous groups) at 1-4 tokens (dense linears) and at one token (the "
    "direct MoE GEMMs) run the CUDA C++ GEMVs of csrc/cuda/int4_gemv.cu (two weights converted an instruction, "
    "tensor-core products) instead of the Triton kernels; other shapes keep the Triton kernels",
    "nvidia", default_text="auto: on where the CUDA C++ kernels are (DEEPINFER_NVIDIA_CUDA_EXT)",
)
INT4_CUDA_SPLIT_K = EnvVar(
    "DEEPINFER_INT4_CUDA_SPLIT_K", "int", 4,
    "warps a 16-row tile's groups are split over in the CUDA int4 MoE GEMVs at one token: `1` (each warp a whole K "
    "loop), `2` (twice the warps in flight), `4` (gate_up over four warps, down over two: the default, fastest "
    "of the three on an H100, 2026-12-06: V2-Lite batch-1 decode 2.15 / 2.11 / 2.09 ms a step) or `8` (gate_up "
    "over eight warps, one batch each, down over four in 1024-thread blocks)",
    "nvidia", choices=(1, 2, 4, 8), error=BackendError,
)
INT4_CUDA_DENSE_WARPS = EnvVar(
    "DEEPINFER_INT4_CUDA_DENSE_WARPS", "int", 8,
    "warps a 16-row tile of the CUDA int4 dense GEMV: `8` (two groups a warp at K 2048; the default dispatch takes it "
    "up to 8 tokens; H100, session 32: o_proj at one token 3.75 us against 4.59) or `4` (four; up to 4 tokens)",
    "nvidia", choices=(4, 8), error=BackendError,
)
INT4_ACT_ORDER_SORT = EnvVar(
    "DEEPINFER_INT4_ACT_ORDER_SORT", "bool", True,
    "`0`: GPTQ act-order int4 weights (the routed experts' gate / up, dense linears) are read as stored, a zero point "
    "and a scale gathered per input channel; `1`: their columns are sorted by group at load and the activations "
    "gathered in that order (Marlin's approach; backends/nvidia/quant/act_order.py, linear_methods.py)",
    "nvidia",
)
MOE_FUSED_COMBINE = EnvVar(
    "DEEPINFER_MOE_FUSED_COMBINE", "bool", True,
    "`0`: direct-mode MoE runs the combine kernel instead of combining in the down GEMM",
    "nvidia",
)
MOE_GROUP_M = EnvVar(
    "DEEPINFER_MOE_GROUP_M", "int", 8,
    "aligned MoE GEMMs: row tiles that run all their column tiles before the next group (`0`: every row tile "
    "before the next column tile, slower at prefill sizes)",
    "nvidia", minimum=0, error=BackendError,
)
MOE_BLOCK_M = EnvVar(
    "DEEPINFER_MOE_BLOCK_M", "int", None,
    "rows per aligned MoE tile: `16`, `32`, `64` or `128`",
    "nvidia", choices=(16, 32, 64, 128), default_text="from routed pairs per expert", error=BackendError,
)
INVARIANT_TILE_FOLLOW_M = EnvVar(
    "DEEPINFER_INVARIANT_TILE_FOLLOW_M", "bool", True,
    "`0`: the batch-invariant kernels keep one tile for every batch size, even where the load-time check found "
    "that a faster tile gives the same bits",
    "nvidia",
)
MOE_SHARED_STREAM = EnvVar(
    "DEEPINFER_MOE_SHARED_STREAM", "bool", True,
    "`0`: run the aligned mode's shared experts inline instead of on a second CUDA stream",
    "nvidia",
)
MOE_FOLD_SHARED_ALIGNED = EnvVar(
    "DEEPINFER_MOE_FOLD_SHARED_ALIGNED", "int", 0,
    "up to this many tokens, quantized shared experts ride in the aligned MoE's grouped GEMMs as extra experts "
    "(every token, weight 1.0) instead of running as a dense MLP beside them; `0`: never (the default: slower at "
    "batch 256 on an H100, docs/quantization.md)",
    "nvidia", minimum=0, error=BackendError,
)
MOE_W8A8_SPLIT_GATE_UP_MIN_PAIRS = EnvVar(
    "DEEPINFER_MOE_W8A8_SPLIT_GATE_UP_MIN_PAIRS", "int", 0,
    "above this many routed pairs per expert (prefill), the fp8 W8A8 MoE runs gate_up as one GEMM over both halves "
    "at 128-row tiles, then a SiLU-and-mul + quant kernel, instead of the fused dual GEMM (which quantizes in its "
    "epilogue); `0`: never (the default: 2-4% slower on an H100 than the dual GEMM at 64-row tiles, "
    "docs/quantization.md; the dual GEMM runs 128-row tiles there since)",
    "nvidia", minimum=0, error=BackendError,
)
INT4_DEQUANT_MIN_M = EnvVar(
    "DEEPINFER_INT4_DEQUANT_MIN_M", "int", 512,
    "tokens from which a dense int4 linear dequantizes its weight and runs cuBLAS instead of the int4 GEMM",
    "nvidia", minimum=1, error=BackendError,
)
FP8_CUBLAS = EnvVar(
    "DEEPINFER_FP8_CUBLAS", "bool", True,
    "`0`: fp8 W8A8 dense linears above the fused activation-quant size run the Triton fp8 GEMM instead of cuBLAS's "
    "block-scaled fp8 GEMM (Hopper, K a multiple of 512)",
    "nvidia",
)
QUANT_SPLIT_K = EnvVar(
    "DEEPINFER_QUANT_SPLIT_K", "bool", True,
    "`0`: the fp8 and int4 dense GEMMs never split K over more programs (by default they do where their grid would "
    "leave SMs idle, up to 16 rows, fp8 with x quantized apart up to 256: quant/split_k.py, 1.13-1.15x at batch 1 on "
    "the H100)",
    "nvidia",
)
FP8_EPILOGUE_QUANT = EnvVar(
    "DEEPINFER_FP8_EPILOGUE_QUANT", "bool", False,
    "`1`: the op before an fp8 W8A8 linear (a decoder layer's RMSNorm, an MLP's SiLU-and-mul) also writes the e4m3 "
    "quantization of its output (backend/fp8_act.py), where by default each consumer quantizes its input in its own "
    "kernel. Off by default: with its rewritten norm kernel, on two H100s (2026-12-06) it ran prefill 1.1-2.0% faster "
    "and batch 256 0-0.4% slower a step; not yet run on the H200 (docs/quantization.md). The quantization config "
    "file's `fuse_quant_dequant` wins where it is set",
    "nvidia",
)
FP8_FUSED_ACT_QUANT_MAX_M = EnvVar(
    "DEEPINFER_FP8_FUSED_ACT_QUANT_MAX_M", "int", 64,
    "largest token count whose fp8 W8A8 GEMM quantizes the activations as it loads them (no separate kernel)",
    "nvidia", minimum=0, error=BackendError,
)
MLA_FUSED_MERGE = EnvVar(
    "DEEPINFER_MLA_FUSED_MERGE", "bool", None,
    "`0` / `1`: force the MLA decode's in-kernel split merge off / on",
    "nvidia", default_text="auto: on up to 4 splits",
)
MLA_MERGE_UV_TILE = EnvVar(
    "DEEPINFER_MLA_MERGE_UV_TILE", "str", None,
    "the MLA decode's merge + W_UV kernel (batches of <= 8): `BLOCK_V,BLOCK_LC,num_warps`, powers of two (the "
    "output columns and latent chunk a program takes; tuning / A/B runs)",
    "nvidia", default_text="`32,512,8` at 32 launched splits, `32,256,8` at 64, `32,512,4` at 16 or fewer",
)
MLA_FP8_KV_DOT = EnvVar(
    "DEEPINFER_MLA_FP8_KV_DOT", "str", "bf16",
    "MLA decode over an fp8 KV cache with bf16 q: the dots in `bf16` (the cache converted through fp32) or "
    "`fp16` (q scaled by a power of two; b256 +4.7% over the bf16 cache where bf16 dots cost +6.6%, H200)",
    "nvidia", choices=("bf16", "fp16"), error=BackendError,
)
MLA_SPLITS = EnvVar(
    "DEEPINFER_MLA_SPLITS", "int", None,
    "MLA decode: splits launched per sequence (read once per process)",
    "nvidia", minimum=1, default_text="launch table",
)
MLA_BLOCK_N = EnvVar(
    "DEEPINFER_MLA_BLOCK_N", "int", None,
    "MLA decode: cache tokens per tile, a power of two >= 16 (read once per process)",
    "nvidia", minimum=16, check=_power_of_two, default_text="launch table",
)
MLA_MIN_SPLIT = EnvVar(
    "DEEPINFER_MLA_MIN_SPLIT", "int", None,
    "MLA decode: fewest tokens a sequence gives one split (read once per process)",
    "nvidia", minimum=1, default_text="launch table",
)

MLA_EXTEND_AS_DECODE_MAX_QUERY = EnvVar(
    "DEEPINFER_MLA_EXTEND_AS_DECODE_MAX_QUERY", "int", 64,
    "MLA: an extend of at most this many query tokens over a cached context of at least 4x as many (and "
    ">= 256) runs as absorbed decode rows (split-KV over the latent cache) instead of up-projecting the "
    "whole context; `0`: never",
    "nvidia", minimum=0,
)

# ---------------------------------------------------------------- CPU backend

CPU_THREADS = EnvVar(
    "DEEPINFER_CPU_THREADS", "int", None,
    "torch intra-op threads the `cpu` backend sets when it starts (`torch.set_num_threads`); `0` leaves "
    "torch's own setting (OMP_NUM_THREADS or one per core) alone",
    "cpu", minimum=0, default_text="`1` (torch's own when `OMP_NUM_THREADS` is set)",
)
CPU_FAST_OPS = EnvVar(
    "DEEPINFER_CPU_FAST_OPS", "bool", True,
    "`0`: the `cpu` backend runs the native reference MLA / MoE ops instead of its batched CPU paths (A/B runs)",
    "cpu",
)
CPU_MOE_DENSE_MAX_WORK = EnvVar(
    "DEEPINFER_CPU_MOE_DENSE_MAX_WORK", "int", None,
    "largest tokens x (experts + shared) x moe_intermediate x hidden the `cpu` MoE runs as two dense GEMMs over "
    "every expert; above it the per-expert loop; `0` turns the dense path off",
    "cpu", minimum=0, default_text="`16777216`",
)

# ---------------------------------------------------------------- tests, CI, benchmarks

TEST_THREADS = EnvVar(
    "DEEPINFER_TEST_THREADS", "int", None,
    "the test suite caps torch's intra-op threads at this (values < 1 count as 1)",
    "dev", default_text="torch's default",
)
COMMIT = EnvVar(
    "DEEPINFER_COMMIT", "str", None,
    "commit that `benchmarks/throughput.py` records (a copy of the tree without .git; `scripts/gpu_run.sh` sets it to "
    "the HEAD and the tree's content id, `scripts/tree_id.sh`)",
    "dev", default_text="`git rev-parse --short HEAD`",
)
CI_VENV = EnvVar(
    "DEEPINFER_CI_VENV", "str", None,
    "where `.ci/run` creates its venv (read by that bash script, not by Python)",
    "dev", default_text="a new temp dir",
)

# ---------------------------------------------------------------- other projects' variables

TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET", "str", None,
    "Triton's: `1` runs kernels in Triton's interpreter (read when a kernel is defined); the NVIDIA backend "
    "then runs on the CPU at tiny shapes",
    "vendor", accepts_text="1 (Triton parses the value)",
)

OMP_NUM_THREADS = EnvVar(
    "OMP_NUM_THREADS", "str", None,
    "OpenMP's (torch follows it at start-up); when set and `DEEPINFER_CPU_THREADS` is not, the `cpu` backend "
    "keeps torch's thread count",
    "vendor", accepts_text="a positive integer (OpenMP parses the value)",
)

DIST_RANK = EnvVar(
    "RANK", "int", None,
    "torchrun's (torch.distributed env rendezvous): this process's global rank; with `WORLD_SIZE` set, the "
    "engine joins that job as that rank and spawns no process (docs/parallelism.md)",
    "vendor", minimum=0,
)

DIST_WORLD_SIZE = EnvVar(
    "WORLD_SIZE", "int", None,
    "torchrun's: the number of processes of the job; must equal tensor_parallel_size x data_parallel_size",
    "vendor", minimum=1,
)

DIST_MASTER_ADDR = EnvVar(
    "MASTER_ADDR", "str", None,
    "torchrun's: the rendezvous host (wins over `--master-addr` when `RANK` / `WORLD_SIZE` are set)",
    "vendor",
)

DIST_MASTER_PORT = EnvVar(
    "MASTER_PORT", "int", None,
    "torchrun's: the rendezvous port (wins over `--master-port` when `RANK` / `WORLD_SIZE` are set)",
    "vendor", minimum=1, maximum=65535,
)

ALL: tuple[EnvVar, ...] = tuple(v for v in globals().values() if isinstance(v, EnvVar))
BY_NAME: dict[str, EnvVar] = {v.name: v for v in ALL}
assert len(BY_NAME) == len(ALL), "an environment variable is declared twice"


def markdown_table() -> str:
    """The README's configuration tables: one per group, `| variable | default | meaning |`."""
    parts = []
    for group, title in GROUPS.items():
        rows = [v for v in ALL if v.group == group]
        if not rows:
            continue
        lines = [f"{title}:", "", "| variable | default | meaning |", "|---|---|---|"]
        lines += [f"| `{v.name}` | {v.default_cell()} | {v.meaning} |" for v in rows]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["--markdown"]:
        print("usage: python -m deepinfer.envs --markdown   (the README's configuration tables)", file=sys.stderr)
        return 2
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
