"""Start-up decisions of the engine: dtype, backend capability check, KV budget, checkpoint facts."""

from __future__ import annotations

import inspect
import json
import logging
import os

import torch

from deepinfer import envs
from deepinfer.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from deepinfer.errors import BackendError, ConfigError, ModelLoadError

logger = logging.getLogger("deepinfer")


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def checkpoint_quantization(hf_config: dict) -> str | None:
    """The linear scheme of the checkpoint's weights ("fp8_block"), another method's name, or None."""
    q = hf_config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    return "fp8_block" if method == "fp8" else (str(method) if method is not None else None)


def generation_eos_ids(path: str) -> set[int]:
    """eos_token_id(s) of generation_config.json; the file is optional, a broken one is an error."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return set()
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file} cannot be read as JSON: {exc}") from exc
    eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
    if eos is None:
        return set()
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
        raise ModelLoadError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return set(ids)


def resolve_dtype(cfg: EngineConfig, ckpt_dtype: torch.dtype | None, backend) -> torch.dtype:
    """dtype "auto": float32 on the CPU backend, else the checkpoint's dtype if supported, else the backend's first."""
    explicit = cfg.torch_dtype()
    if explicit is not None:
        return explicit
    caps = backend.caps
    if caps.device_type == "cpu" and torch.float32 in caps.dtypes:
        chosen, why = torch.float32, "the CPU backend computes in float32 by default"
    elif ckpt_dtype is not None and ckpt_dtype in caps.dtypes:
        chosen, why = ckpt_dtype, "the checkpoint's dtype"
    else:
        chosen, why = caps.dtypes[0], f"backend {backend.name!r}'s preferred dtype"
    ckpt = dtype_name(ckpt_dtype) if ckpt_dtype is not None else "unstated"
    logger.info("dtype auto -> %s (%s; checkpoint dtype %s)", dtype_name(chosen), why, ckpt)
    return chosen


# model types whose KV cache can be stored in fp8: the MLA latent cache (V4's groups are not quantized)
FP8_KV_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def check_backend(backend, cfg: EngineConfig, dtype, quantization, model_type, fuse_act_quant: bool = False,
                  moe_quantization: str | None = None) -> None:
    """BackendError listing every reason the backend cannot serve this configuration (fuse_act_quant: the config
    file asked for the fused act quant, `fuse_quant_dequant: true`; moe_quantization: the routed-expert scheme it
    asked for, `method: fp4`)."""
    from deepinfer.backend import FeatureRequest

    kv_storage = cfg.kv_cache_storage()
    reasons = backend.caps.unsupported(
        FeatureRequest(
            dtype=dtype,
            quantization=quantization,
            model_type=model_type,
            tensor_parallel_size=cfg.parallel_layout().world_size,  # every device of the job, DP replicas too
            batch_invariant=cfg.batch_invariant,
            kv_block_size=cfg.block_size or backend.caps.kv_block_sizes[0],
            kv_cache_dtype=kv_storage,
            fuse_act_quant=fuse_act_quant,
            moe_quantization=moe_quantization,
        )
    )
    if kv_storage != "auto" and model_type not in FP8_KV_MODEL_TYPES:
        reasons.append(f"EngineConfig.kv_cache_dtype={cfg.kv_cache_dtype!r} (--kv-cache-dtype): an fp8 KV cache "
                       f"is built for the MLA latent cache of model_type {' / '.join(FP8_KV_MODEL_TYPES)}, not "
                       f"{model_type!r} (V4's window and compressed caches are not quantized)")
    if reasons:
        raise BackendError(f"backend {backend.name!r} cannot run this configuration:\n  - " + "\n  - ".join(reasons))


def kv_budget_bytes(cfg: EngineConfig, backend, model, block_size: int, token_budget: int, max_model_len: int,
                    layouts=None) -> int:
    """Bytes the KV cache may take: explicit, the CPU default, or what the device has left.

    On a device that reports memory, one profiling forward of the full token budget runs
    first, so free memory already excludes weights and the activation peak; the cache gets
    free - (1 - gpu_memory_utilization) * total.
    """
    if cfg.kv_cache_memory_bytes is not None:
        return cfg.kv_cache_memory_bytes
    if backend.caps.device_type == "cpu":
        return DEFAULT_CPU_KV_CACHE_BYTES
    from deepinfer.worker.profile_run import profile_forward

    profile_forward(model, block_size, token_budget, max_model_len, cfg.max_num_seqs, backend.device, layouts)
    backend.synchronize()
    free, total = backend.memory_info()
    budget = int(free - (1.0 - cfg.gpu_memory_utilization) * total)
    if budget <= 0:
        raise BackendError(
            f"no device memory left for the KV cache: {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB "
            f"after loading the model and a profiling forward, gpu_memory_utilization={cfg.gpu_memory_utilization}"
        )
    return budget


def use_async_scheduling(cfg: EngineConfig, backend, kv) -> bool:
    """Whether engine steps overlap the host's work with the device (sched/step_pipeline.py).

    None (the default) = on where the device runs asynchronously to the host (an accelerator
    with a stream), off on the CPU, where the forward runs inside the host's call and there is
    nothing to overlap. Models with per-sequence state (V4's compressor rows) always run sync:
    their state rows are reset and read on the host's schedule, and the pending-token path is
    not proven for them. True on the CPU is allowed (tests check async == sync there).
    """
    want = cfg.async_scheduling
    if want is None:
        want = backend.device.type != "cpu"
    if want and kv.uses_state:
        if cfg.async_scheduling:
            logger.info("async scheduling is off: this model keeps per-sequence state (V4); steps run sync")
        return False
    return bool(want)


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (model, tokenizer, caches) out of the cyclic GC's view.

    Python's generational GC otherwise re-scans these long-lived objects in its gen-2
    collections, triggered by the many small objects each step allocates (vLLM does the same).
    Objects are still freed by reference counting; only cycles among them are never collected.
    At exit they are unfrozen, so the interpreter's final collection still sees them (nanobind
    extensions such as Triton's report frozen objects as leaks otherwise).
    """
    import atexit
    import gc

    global _unfreeze_registered
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True


_unfreeze_registered = False


def use_prefix_caching(cfg: EngineConfig, specs, model=None) -> bool:
    """EngineConfig.enable_prefix_caching resolved: None = on where every KV group allows it (and, for
    per-sequence state, where the model saves that state at block boundaries: `use_state_snapshots`)."""
    from deepinfer.kv.prefix_cache import prefix_caching_refusals

    reasons = prefix_caching_refusals(specs)
    if model is not None and any(s.state_shape for s in specs) and not hasattr(model, "use_state_snapshots"):
        reasons.append(f"{type(model).__name__} keeps per-sequence state but cannot snapshot it at block "
                       "boundaries (it has no use_state_snapshots)")
    if cfg.enable_prefix_caching and reasons:
        raise ConfigError("EngineConfig.enable_prefix_caching=True (--enable-prefix-caching) cannot run on this "
                          "model: " + "; ".join(reasons))
    if cfg.enable_prefix_caching is None and reasons:
        logger.info("prefix caching off for this model: %s", "; ".join(reasons))
        return False
    return cfg.enable_prefix_caching is not False


def cache_salt(model, block_size: int, backend=None, kv_cache_dtype: str = "auto") -> bytes:
    """What besides the tokens fixes a KV block: the parsed model config (shapes, rope scaling, routing,
    quantization), the compute dtype, the block size, how the linears run (W8A16 or W8A8, online quantization:
    the same fp8 checkpoint gives other KV bits either way), and the backend with its batch-invariance mode
    (other kernels, other bits: a disk tier shared by differently configured servers must not mix them, or a
    batch-invariant run could read a block a default run wrote), and the KV storage (EngineConfig.kv_cache_storage():
    an fp8 cache's blocks are other bytes; "auto" adds nothing, so the compute-dtype salts stay as they were).
    Part of every prefix-cache key, the host and disk tiers' included."""
    import hashlib

    h = hashlib.sha256(repr(model.config).encode())
    h.update(f"|{model.dtype}|{getattr(model, 'quantization', None)}|{block_size}".encode())
    modules = getattr(model, "modules", None)
    if modules is not None:  # the linear methods the layers run (e.g. fp8 as W8A16 or as W8A8)
        methods = sorted({type(m.method).__name__ for m in modules() if getattr(m, "method", None) is not None})
        h.update(f"|{','.join(methods)}".encode())
    if backend is not None:
        h.update(f"|{type(backend).__name__}|invariant={getattr(backend, 'batch_invariance_enabled', False)}".encode())
    n_mtp = len(getattr(model, "mtp", ()) or ())
    if n_mtp:  # the blocks also hold the MTP layers' KV (speculative decoding): another layout
        h.update(f"|mtp{n_mtp}".encode())
    if kv_cache_dtype != "auto":  # fp8 blocks (and the per-layer scales they were written with)
        scales = [getattr(m.attn, "kv_scale", 1.0) for m in modules() if hasattr(m, "attn")] if modules else []
        h.update(f"|kv={kv_cache_dtype}|scales={scales}".encode())
    return h.digest()


def snapshot_bytes(specs, block_size: int, layouts) -> int:
    """Bytes of V4's compressor-state snapshot kept beside each sliding-window block (0 without state)."""
    from deepinfer.kv.state_snapshots import snapshot_bytes_per_block

    return snapshot_bytes_per_block(specs, block_size, layouts)


def attach_state_snapshots(kv, model, caches, num_slots: int) -> None:
    """Prefix caching on V4: the store of compressor state at block boundaries, one slot per window block,
    filled by the model's compressor ops (model.use_state_snapshots) and read back on a hit."""
    from deepinfer.kv.state_snapshots import StateSnapshots

    store = StateSnapshots(caches, num_slots)
    kv.attach_state_snapshots(store)
    model.use_state_snapshots(store)
    logger.info("prefix caching: compressor state snapshots for %d window blocks, %.2f MiB", num_slots,
                store.nbytes / 2**20)


def attach_lower_tiers(cfg: EngineConfig, kv, caches) -> None:
    """The prefix cache's host tier (EngineConfig.kv_host_cache_gib) and disk tier (kv_disk_cache_dir),
    keyed by the same salt as the cache."""
    from deepinfer.kv.disk_tier import DiskTier
    from deepinfer.kv.host_tier import HostTier
    from deepinfer.worker.kv_block_io import KVBlockIO

    if not kv.prefix_caching:
        raise ConfigError("EngineConfig.kv_host_cache_gib / kv_disk_cache_dir need prefix caching, which is off "
                          "for this model")
    # V4: one block io per group; the window group's carries the state snapshots too (kv/tier_traffic.py)
    ios = {s.name: KVBlockIO(caches, s.name) for s in kv.specs}
    io = ios[kv.specs[0].name]
    host = disk = None
    if cfg.kv_host_cache_gib is not None:
        host = HostTier(int(cfg.kv_host_cache_gib * 1024**3))  # its pool is allocated once by attach_tiers
        logger.info("kv host cache: %.2f GiB, allocated at start-up%s", cfg.kv_host_cache_gib,
                    " (pinned)" if io.device.type == "cuda" else "")
    if cfg.kv_disk_cache_dir is not None:
        disk = DiskTier(cfg.kv_disk_cache_dir, int(cfg.kv_disk_cache_gib * 1024**3), cfg.kv_retention_hours,
                        kv.cache_salt)
        logger.info("kv disk cache at %s (%.1f GiB, %g h retention)", disk.root, cfg.kv_disk_cache_gib,
                    cfg.kv_retention_hours)
    kv.attach_tiers(host, disk, ios if len(ios) > 1 else io)


# backends whose MLA op serves verification steps (1 + k query tokens per sequence on a cached context); any
# backend on the CPU device (the cpu backend, nvidia under the Triton interpreter, test stand-ins) also may
SPEC_BACKENDS = ("cpu", "nvidia")


def check_speculation(cfg: EngineConfig, backend, model_type: str | None, num_mtp_layers: int) -> None:
    """What speculative decoding cannot run with yet: a ConfigError naming the flag, never a fallback.

    num_mtp_layers: the checkpoint's MTP modules (config.json num_nextn_predict_layers)."""

    if cfg.spec_method() is None:
        return
    head = (f"speculative decoding (speculative_method={cfg.spec_method()!r}, --speculative-method / "
            "DEEPINFER_ENABLE_MTP_VARLEN / DEEPINFER_USE_NEXTN_DECODE)")
    reasons = []
    if cfg.spec_method() == "mtp" and not num_mtp_layers:
        reasons.append(f"the model ({model_type}) has no MTP module (config.json num_nextn_predict_layers is 0)")
    if cfg.async_scheduling:
        reasons += [f"async_scheduling=True (--async-scheduling / DEEPINFER_ASYNC_SCHEDULING=1): {why}; leave it "
                    "unset or off" for why in chaining_refusals(cfg, backend, model_type)]
    if backend.caps.device_type != "cpu" and backend.name not in SPEC_BACKENDS:
        reasons.append(f"backend {backend.name!r}: verification steps are built and tested on the "
                       f"{' and '.join(SPEC_BACKENDS)} backends only")
    if reasons:
        raise ConfigError(f"{head} cannot run: " + "; ".join(reasons))
    if backend.name == "nvidia" and backend.caps.device_type != "cpu":
        logger.warning("speculative decoding on the nvidia backend: its MTP drafting graphs are tested under the "
                       "Triton interpreter only, not yet measured on a GPU (docs/speculative.md)")
    if cfg.async_scheduling is None and backend.device.type != "cpu":
        logger.info("speculative decoding: steps run sync (async scheduling off)")
    if not cfg.enforce_eager and backend.caps.graph_capture:
        logger.info("speculative decoding: verify steps replay the decode graphs as decode rows where the buckets "
                    "cover them (spec/verify_batch.py); the MTP pass and chain replay their own graphs "
                    "(backend/mtp_graph_runner.py)")


def chaining_refusals(cfg: EngineConfig, backend, model_type: str | None) -> list[str]:
    """Why speculative steps cannot be scheduled async (spec/chained_steps.py: the next one-sync step launched on
    the device results of the one in flight) on this engine; [] when they can."""
    why = []
    if cfg.spec_method() != "mtp":
        why.append("async speculative steps take MTP drafts from the device (n-gram drafts are the host's)")
    if cfg.enforce_eager or not backend.caps.graph_capture:
        why.append("async speculative steps replay the decode and MTP graphs ("
                   + ("enforce_eager" if cfg.enforce_eager else f"backend {backend.name!r} captures none") + ")")
    if model_type == "deepseek_v4":
        why.append("a model with per-sequence state (V4) runs no decode or MTP graphs")
    if not envs.SPEC_ONE_SYNC.get() or not envs.SPEC_OVERLAP_OUTPUT.get():
        why.append("async speculative steps are one-sync steps with overlapped output (DEEPINFER_SPEC_ONE_SYNC and "
                   "DEEPINFER_SPEC_OVERLAP_OUTPUT must be on)")
    if cfg.tensor_parallel_size > 1 or cfg.context_parallel_size > 1:
        why.append("async speculative steps run on one rank (tensor / context parallelism: not built)")
    return why


def engine_kv_specs(cfg: EngineConfig, model, kv_dtype) -> tuple[list, int]:
    """The engine's KV groups (model.kv_cache_specs: the MTP layers' with MTP drafts, the storage dtype), and the
    tokens a per-sequence state may roll back (KVCacheManager.state_rollback_tokens). With speculation on a model
    whose groups keep per-sequence state (V4's compressor rings), the rings are built k positions longer
    (ring_margin), so a verify step's rejected drafts (at most k) roll back; a model that cannot is refused."""
    kw = {"kv_cache_dtype": kv_dtype} if kv_dtype is not None else {}
    if cfg.spec_method() == "mtp":
        kw["include_mtp"] = True
    specs = model.kv_cache_specs(**kw)
    state_rollback = cfg.spec_num_tokens() if any(s.state_shape for s in specs) else 0
    if state_rollback:
        if "ring_margin" not in inspect.signature(model.kv_cache_specs).parameters:
            raise ConfigError(f"speculative decoding on {type(model).__name__}: its KV groups keep per-sequence "
                              "state, and its kv_cache_specs takes no ring_margin (the rollback its state allows)")
        specs = model.kv_cache_specs(**kw, ring_margin=state_rollback)
    return specs, state_rollback


def window_rollback(cfg: EngineConfig, specs) -> int:
    """The sliding-window groups' rollback margin (EngineConfig.window_rollback_tokens); with speculation, one below
    k is refused (a verify step's rejected drafts roll a window back by up to k tokens)."""
    rollback = cfg.window_rollback_tokens(any(s.sliding_window for s in specs))
    if cfg.spec_method() and any(s.sliding_window for s in specs) and rollback < cfg.spec_num_tokens():
        raise ConfigError(f"kv_window_rollback_tokens={rollback} (--kv-window-rollback-tokens) is below "
                          f"num_speculative_tokens={cfg.spec_num_tokens()}: a verify step's rejected drafts roll "
                          "a sliding window back by up to that many tokens (leave it unset: 140)")
    return rollback
