"""EngineConfig: every engine setting, and the one place the engine's DEEPINFER_* environment variables
(declared in deepinfer/envs.py) map onto it."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deepinfer import envs
from deepinfer.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}

# User-facing quantization names -> the linear scheme the backend must support.
QUANTIZATIONS: dict[str, str] = {"fp8": "fp8_block", "fp8_block": "fp8_block"}

# EngineConfig.kv_cache_dtype values -> the canonical name backends declare (BackendCaps.kv_cache_dtypes)
KV_CACHE_DTYPE_NAMES: dict[str, str] = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}

# Without a device memory query (the CPU), the KV cache gets this many bytes unless told otherwise.
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024**2

# Speculative decoding (docs/speculative.md): the methods, the default and the largest draft length.
SPECULATIVE_METHODS = ("mtp", "ngram")
DEFAULT_SPECULATIVE_TOKENS = 5
MAX_SPECULATIVE_TOKENS = 16

# Expert parallelism's token dispatch (EngineConfig.ep_dispatch; models/layers/ep_all_to_all.py keeps the same
# names and default, tests/parallel/test_ep_all_to_all.py checks they agree).
EP_DISPATCH_MODES = ("auto", "all_to_all", "all_gather")
DEFAULT_EP_ALL_TO_ALL_MIN_TOKENS = 256


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class EngineConfig:
    """All engine settings. Field names follow vLLM where one exists.

    model_name_or_path: a checkpoint directory; None = the embedded stdlib-coder model (docs/models.md).
    max_model_len: None = the model's max_position_embeddings.
    tensor_parallel_size / data_parallel_size / enable_expert_parallel: many devices (docs/parallelism.md):
        tensor_parallel_size x data_parallel_size processes, one per device; attention heads, dense MLPs and
        the vocabulary split over tensor_parallel_size; each data-parallel replica schedules its own requests;
        with enable_expert_parallel the routed experts are spread (whole) over every rank.
    context_parallel_size / cp_min_prefill_tokens: context-parallel prefill (docs/parallelism.md): a replica of
        context_parallel_size ranks, each with the whole model; a step with at least cp_min_prefill_tokens
        prefill tokens splits its query tokens over them (load-balanced "zigzag" chunks), every rank keeps
        the whole KV cache. So far only with tensor_parallel_size = data_parallel_size = 1.
    enable_eplb / eplb_num_redundant_experts / eplb_step_interval: the expert load balancer (parallel/eplb.py):
        per-expert load counted online, that many redundant copies of hot experts placed over the ranks, and
        the placement recomputed every eplb_step_interval engine steps, between steps.
    ep_dispatch / ep_all_to_all_min_tokens: how the expert-parallel MoE layers move tokens (docs/parallelism.md,
        "Dispatch modes"): "all_gather" (every replica's hidden states to every rank, one all-reduce),
        "all_to_all" (each routed pair to the rank of its expert and back), or "auto": all_to_all from
        ep_all_to_all_min_tokens tokens per forward (summed over the data-parallel replicas), else all_gather.
    nnodes / node_rank / master_addr / master_port: the env-style rendezvous of torch.distributed for several
        nodes (torchrun-compatible; RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment win).
        master_port None on one node = a free port.
    dist_timeout_s: the longest a collective (or the start-up rendezvous) may wait for a rank before every
        rank stops with an error naming it.
    dtype: "auto" = the checkpoint's dtype when the backend supports it, else the
        backend's best; on the CPU backend "auto" computes in float32.
    block_size: tokens per KV block; None = the backend's preferred size.
    kv_cache_memory_bytes / num_kv_blocks: size the KV cache explicitly
        (num_kv_blocks = blocks of each full-attention group; other groups follow).
        Otherwise a GPU backend uses gpu_memory_utilization of its memory and the
        CPU uses DEFAULT_CPU_KV_CACHE_BYTES.
    max_num_batched_tokens: the per-step token budget; None = 4096 with chunked
        prefill, else max_model_len.
    speculative_method: "mtp" (draft with the checkpoint's MTP module, docs/speculative.md), "ngram" (prompt
        lookup: drafts copied from earlier in the sequence, any model) or None (off).
    num_speculative_tokens: the most drafted tokens verified per step (k); None = 5 when speculation is on.
    speculative_adaptive: the confidence scheduler picks each request's k per step (spec/scheduler.py);
        off = every decoding request verifies the static k (capped by max_tokens / max_model_len).
    enable_mtp_varlen / use_nextn_decode: the environment's aliases (DEEPINFER_ENABLE_MTP_VARLEN=1 means
        speculative_method="mtp"; DEEPINFER_USE_NEXTN_DECODE=N > 0 means "mtp" with num_speculative_tokens=N).
    enable_prefix_caching: reuse the KV of cached prompt prefixes (kv/prefix_cache.py). None = on where
        the KV groups allow it: V2 / V3, and V4 (hybrid cache: window blocks, compressed blocks and compressor
        state snapshots, docs/kv-cache.md "V4"); off, with an info line, for a layout prefix_caching_refusals
        names; True on such a model is an error naming the groups.
    kv_host_cache_gib: the prefix cache's host tier (kv/host_tier.py): evicted device blocks are kept in
        that many GiB of host memory (pinned on a GPU), and pushed on to the disk tier from there. None = off.
    kv_disk_cache_dir / kv_disk_cache_gib / kv_retention_hours: the prefix cache's disk tier
        (kv/disk_tier.py): evicted blocks go to files there, at most that many GiB, kept that many hours
        (default 72); a restarted engine on the same model finds them. None = no disk tier.
    kv_window_rollback_tokens: tokens a sliding-window group keeps behind its window (V4), so a rollback that
        far (speculative decoding's rejected drafts) finds its keys and a prefix hit replays the window plus
        this margin (docs/kv-cache.md). None = 140 when speculative decoding runs on a sliding-window model,
        else 0 (nothing rolls a window back).
    kv_cache_dtype: how the KV cache stores entries: "auto" = the compute dtype; "fp8" / "fp8_e4m3" = the
        MLA latent cache of the V2 / V3 family in float8_e4m3fn with a per-layer scale (1.0 unless the
        checkpoint gives one), half the bytes of bf16 (docs/quantization.md "fp8 KV cache"). Refused at
        start-up, with the reason, by a backend or model (V4) without it.
    async_scheduling: schedule and launch step N+1 while the device runs step N
        (sched/step_pipeline.py); outputs are identical either way. None = on where the
        backend runs on an accelerator, off on the CPU; models with per-sequence state
        (V4) always run sync. DEEPINFER_ASYNC_SCHEDULING=0/1 sets it when left None.
    structured_output_backend: the grammar engine of SamplingParams.structured_outputs
        (docs/structured-output.md): "llguidance" (default) or "xgrammar" (optional package).
    structured_output_compile_timeout_s / structured_output_max_bytes: a structured-output spec
        (schema, regex, grammar, choices) larger than max_bytes, or whose compile takes longer than
        the timeout, is refused at add_request (StructuredOutputError).
    """

    model_name_or_path: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    context_parallel_size: int = 1
    cp_min_prefill_tokens: int = 1024
    enable_eplb: bool = False
    eplb_num_redundant_experts: int = 0
    eplb_step_interval: int = 1000
    ep_dispatch: str = "auto"
    ep_all_to_all_min_tokens: int = DEFAULT_EP_ALL_TO_ALL_MIN_TOKENS
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    dist_timeout_s: float = 300.0
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    quantization: str | None = None
    quantization_config: str | dict | None = None  # a quant.yaml path or its mapping (deepinfer/quant_config.py)
    device: str | None = None
    dtype: str | torch.dtype = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    seed: int = 0
    batch_invariant: bool = False
    max_waiting_requests: int = 4096
    enable_mtp_varlen: bool = False
    use_nextn_decode: int = 0
    load_progress: bool = True
    async_scheduling: bool | None = None
    enable_prefix_caching: bool | None = None
    kv_host_cache_gib: float | None = None
    kv_disk_cache_dir: str | None = None
    kv_disk_cache_gib: float = 10.0
    kv_retention_hours: float = 72.0
    kv_window_rollback_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    structured_output_backend: str = "llguidance"
    structured_output_compile_timeout_s: float = 10.0
    structured_output_max_bytes: int = 256 * 1024
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    speculative_adaptive: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def window_rollback_tokens(self, has_window: bool) -> int:
        """kv_window_rollback_tokens resolved (see the field)."""
        if self.kv_window_rollback_tokens is not None:
            return self.kv_window_rollback_tokens
        return 140 if has_window and self.spec_method() else 0

    def parallel_layout(self):
        """The rank layout these settings describe (deepinfer/parallel/layout.py)."""
        from deepinfer.parallel.layout import ParallelLayout

        return ParallelLayout(self.tensor_parallel_size, self.data_parallel_size, self.enable_expert_parallel,
                              self.context_parallel_size)

    def _validate_parallel(self, bad) -> None:
        for name in ("data_parallel_size", "nnodes", "context_parallel_size"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "must be an integer >= 1")
        if not _is_int(self.cp_min_prefill_tokens) or self.cp_min_prefill_tokens < 1:
            raise bad("cp_min_prefill_tokens", "must be an integer >= 1 (prefill tokens of a step that is split "
                                               "over the context-parallel ranks)")
        for name in ("enable_expert_parallel", "enable_eplb"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if not _is_int(self.eplb_num_redundant_experts) or self.eplb_num_redundant_experts < 0:
            raise bad("eplb_num_redundant_experts", "must be an integer >= 0")
        if not _is_int(self.eplb_step_interval) or self.eplb_step_interval < 1:
            raise bad("eplb_step_interval", "must be an integer >= 1 (engine steps between re-balancings)")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise bad("enable_eplb", "needs enable_expert_parallel=True (the balancer places experts over ranks)")
        if self.eplb_num_redundant_experts and not self.enable_eplb:
            raise bad("eplb_num_redundant_experts", "needs enable_eplb=True")
        self._validate_ep_dispatch(bad)
        if not _is_int(self.node_rank) or not 0 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"must be an integer in [0, nnodes={self.nnodes})")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise bad("master_addr", "must be a host name or address")
        if self.master_port is not None and (not _is_int(self.master_port) or not 0 < self.master_port < 65536):
            raise bad("master_port", "must be a TCP port in [1, 65535] or None (a free port on one node)")
        if isinstance(self.dist_timeout_s, bool) or not isinstance(self.dist_timeout_s, (int, float)) \
                or not self.dist_timeout_s > 0:
            raise bad("dist_timeout_s", "must be a positive number of seconds")
        world = self.tensor_parallel_size * self.data_parallel_size if _is_int(self.tensor_parallel_size) else 1
        world *= self.context_parallel_size
        if self.nnodes > 1 and world % self.nnodes:
            raise bad("nnodes", f"must divide the world size tensor_parallel_size x context_parallel_size x "
                                f"data_parallel_size = {world}")

    def _validate_ep_dispatch(self, bad) -> None:
        if not isinstance(self.ep_dispatch, str) or self.ep_dispatch not in EP_DISPATCH_MODES:
            raise bad("ep_dispatch", f"must be one of {', '.join(EP_DISPATCH_MODES)}")
        if not _is_int(self.ep_all_to_all_min_tokens) or self.ep_all_to_all_min_tokens < 1:
            raise bad("ep_all_to_all_min_tokens", "must be an integer >= 1 (tokens per forward, summed over the "
                                                  "data-parallel replicas, from which ep_dispatch='auto' uses "
                                                  "all_to_all)")
        if self.ep_dispatch != "auto" and not self.enable_expert_parallel:
            raise bad("ep_dispatch", "needs enable_expert_parallel=True (it says how the expert-parallel MoE layers "
                                     "move tokens)")
        if self.ep_all_to_all_min_tokens != DEFAULT_EP_ALL_TO_ALL_MIN_TOKENS:
            if not self.enable_expert_parallel:
                raise bad("ep_all_to_all_min_tokens", "needs enable_expert_parallel=True")
            if self.ep_dispatch != "auto":
                raise bad("ep_all_to_all_min_tokens", f"is read by ep_dispatch='auto' only (ep_dispatch is "
                                                      f"{self.ep_dispatch!r})")

    def validate(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"EngineConfig.{name} {why} (got {getattr(self, name)!r})")

        if self.model_name_or_path is None:
            from deepinfer.data import embedded_model_path

            self.model_name_or_path = embedded_model_path()
        if not isinstance(self.model_name_or_path, (str, os.PathLike)) or not str(self.model_name_or_path):
            raise bad("model_name_or_path", "must be a non-empty path to a model directory")
        self.model_name_or_path = str(self.model_name_or_path)
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "must be an integer >= 1")
        self._validate_parallel(bad)
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise bad("max_model_len", "must be an integer >= 2 or None")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool) \
                or not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be a number in (0, 1]")
        if not isinstance(self.enforce_eager, bool):
            raise bad("enforce_eager", "must be a bool")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"must be None (use the checkpoint's) or one of {sorted(QUANTIZATIONS)}")
        if self.quantization_config is not None:
            from deepinfer.quant_config import parse_quant_config

            parse_quant_config(self.quantization_config)  # ConfigError naming the file's key
        if self.device is not None and (not isinstance(self.device, str) or not self.device.strip()):
            raise bad("device", "must be auto, cpu, cuda, npu or a backend name")
        if isinstance(self.dtype, torch.dtype):
            if self.dtype not in DTYPES.values():
                raise bad("dtype", "must be auto, bfloat16, float16 or float32")
        elif not isinstance(self.dtype, str) or (self.dtype != "auto" and self.dtype not in DTYPES):
            raise bad("dtype", "must be auto, bfloat16, float16 or float32")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be an integer >= 1")
        if self.max_num_batched_tokens is not None and (
            not _is_int(self.max_num_batched_tokens) or self.max_num_batched_tokens < 1
        ):
            raise bad("max_num_batched_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise bad("enable_chunked_prefill", "must be a bool")
        if self.block_size is not None and (not _is_int(self.block_size) or self.block_size < 1):
            raise bad("block_size", "must be a positive integer or None")
        if self.kv_cache_memory_bytes is not None and (
            not _is_int(self.kv_cache_memory_bytes) or self.kv_cache_memory_bytes < 1
        ):
            raise bad("kv_cache_memory_bytes", "must be a positive integer or None")
        if self.num_kv_blocks is not None and (not _is_int(self.num_kv_blocks) or self.num_kv_blocks < 1):
            raise bad("num_kv_blocks", "must be a positive integer or None")
        if self.kv_cache_memory_bytes is not None and self.num_kv_blocks is not None:
            raise ConfigError("EngineConfig.kv_cache_memory_bytes and EngineConfig.num_kv_blocks are exclusive: set one")
        if not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            raise bad("enable_prefix_caching", "must be a bool or None (on where the model's KV groups allow it)")
        if self.kv_disk_cache_dir is not None and (not isinstance(self.kv_disk_cache_dir, (str, os.PathLike))
                                                   or not str(self.kv_disk_cache_dir)):
            raise bad("kv_disk_cache_dir", "must be a directory path or None (no disk tier)")
        if self.kv_host_cache_gib is not None and (isinstance(self.kv_host_cache_gib, bool) or not isinstance(
                self.kv_host_cache_gib, (int, float)) or not self.kv_host_cache_gib > 0):
            raise bad("kv_host_cache_gib", "must be a positive number or None (no host tier)")
        if self.kv_host_cache_gib is not None and self.enable_prefix_caching is False:
            raise bad("kv_host_cache_gib", "needs prefix caching (enable_prefix_caching is False)")
        if self.kv_window_rollback_tokens is not None and (not _is_int(self.kv_window_rollback_tokens)
                                                           or self.kv_window_rollback_tokens < 0):
            raise bad("kv_window_rollback_tokens", "must be an integer >= 0 or None")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise bad("kv_cache_dtype", f"must be one of {list(KV_CACHE_DTYPE_NAMES)} (--kv-cache-dtype)")
        for name in ("kv_disk_cache_gib", "kv_retention_hours"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise bad(name, "must be a positive number")
        if self.kv_disk_cache_dir is not None and self.enable_prefix_caching is False:
            raise bad("kv_disk_cache_dir", "needs prefix caching (enable_prefix_caching is False)")
        if not isinstance(self.batch_invariant, bool):
            raise bad("batch_invariant", "must be a bool")
        if not _is_int(self.max_waiting_requests) or self.max_waiting_requests < 1:
            raise bad("max_waiting_requests", "must be an integer >= 1")
        if not isinstance(self.enable_mtp_varlen, bool):
            raise bad("enable_mtp_varlen", "must be a bool")
        if not _is_int(self.use_nextn_decode) or self.use_nextn_decode < 0:
            raise bad("use_nextn_decode", "must be an integer >= 0 (0 = off)")
        if not isinstance(self.load_progress, bool):
            raise bad("load_progress", "must be a bool")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise bad("async_scheduling", "must be a bool or None (auto)")
        if self.structured_output_backend not in ("llguidance", "xgrammar"):
            raise bad("structured_output_backend", "must be 'llguidance' or 'xgrammar'")
        v = self.structured_output_compile_timeout_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 3600:
            raise bad("structured_output_compile_timeout_s", "must be a number of seconds in (0, 3600]")
        if not _is_int(self.structured_output_max_bytes) or self.structured_output_max_bytes < 1:
            raise bad("structured_output_max_bytes", "must be a positive integer")
        self._validate_speculation(bad)

    def _validate_speculation(self, bad) -> None:
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise bad("speculative_method", f"must be None (off) or one of {list(SPECULATIVE_METHODS)}")
        if self.num_speculative_tokens is not None and (
                not _is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise bad("num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] or None (5)")
        if not isinstance(self.speculative_adaptive, bool):
            raise bad("speculative_adaptive", "must be a bool")
        if self.use_nextn_decode > MAX_SPECULATIVE_TOKENS:
            raise bad("use_nextn_decode", f"must be at most {MAX_SPECULATIVE_TOKENS} drafted tokens")
        if self.use_nextn_decode and self.num_speculative_tokens not in (None, self.use_nextn_decode):
            raise ConfigError(f"EngineConfig.use_nextn_decode={self.use_nextn_decode} (DEEPINFER_USE_NEXTN_DECODE) "
                              f"and num_speculative_tokens={self.num_speculative_tokens} disagree: set one")
        if (self.enable_mtp_varlen or self.use_nextn_decode) and self.speculative_method not in (None, "mtp"):
            raise ConfigError("EngineConfig.enable_mtp_varlen / use_nextn_decode (DEEPINFER_ENABLE_MTP_VARLEN / "
                              f"DEEPINFER_USE_NEXTN_DECODE) ask for MTP drafts but speculative_method="
                              f"{self.speculative_method!r}")
        if self.spec_method() is None and (self.num_speculative_tokens is not None or self.speculative_adaptive):
            which = "num_speculative_tokens" if self.num_speculative_tokens is not None else "speculative_adaptive"
            raise bad(which, "needs speculative_method (--speculative-method mtp or DEEPINFER_ENABLE_MTP_VARLEN=1)")

    def spec_method(self) -> str | None:
        """The speculation method in effect, the environment's aliases folded in (None: off)."""
        if self.speculative_method is not None:
            return self.speculative_method
        return "mtp" if self.enable_mtp_varlen or self.use_nextn_decode else None

    def spec_num_tokens(self) -> int:
        """k: the most drafted tokens verified per step (0 when speculation is off)."""
        if self.spec_method() is None:
            return 0
        return self.num_speculative_tokens or self.use_nextn_decode or DEFAULT_SPECULATIVE_TOKENS

    # ------------------------------------------------------------ environment

    def with_env(self, environ: Mapping[str, str] | None = None) -> "EngineConfig":
        """A copy with the engine's DEEPINFER_* variables (deepinfer/envs.py) applied, read from `environ`
        (default os.environ). Explicit fields win over the environment: device set here beats
        DEEPINFER_DEVICE; a flag turned on here stays on."""
        changes: dict = {}
        device = envs.DEVICE.get(environ)  # a blank value raises: "DEEPINFER_DEVICE is empty: ..."
        if device is not None and self.device is None:
            changes["device"] = device.strip()
        if envs.BATCH_INVARIANT.get(environ):
            changes["batch_invariant"] = True
        if envs.ENABLE_MTP_VARLEN.get(environ):
            changes["enable_mtp_varlen"] = True
        if self.async_scheduling is None:  # only read when the field leaves it to the environment
            async_scheduling = envs.ASYNC_SCHEDULING.get(environ)
            if async_scheduling is not None:
                changes["async_scheduling"] = async_scheduling
        nextn = envs.USE_NEXTN_DECODE.get(environ)
        if nextn and self.use_nextn_decode == 0:
            changes["use_nextn_decode"] = nextn
        return dataclasses.replace(self, **changes) if changes else self

    def check_features_exist(self) -> None:
        """Features that are named in the flags but not built yet fail here, at start-up. Speculation's
        combinations that cannot run are refused in engine/startup.py: check_speculation."""

    # ------------------------------------------------------------ derived values

    def torch_dtype(self) -> torch.dtype | None:
        """The explicit compute dtype, or None for "auto"."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        return None if self.dtype == "auto" else DTYPES[self.dtype]

    def kv_cache_storage(self) -> str:
        """kv_cache_dtype's canonical name: "auto" or "fp8_e4m3" (what BackendCaps.kv_cache_dtypes lists)."""
        return KV_CACHE_DTYPE_NAMES[self.kv_cache_dtype]

    def linear_scheme(self) -> str | None:
        return None if self.quantization is None else QUANTIZATIONS[self.quantization]

    def token_budget(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 4096 if self.enable_chunked_prefill else max_model_len

