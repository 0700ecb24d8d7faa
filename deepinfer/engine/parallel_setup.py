"""The engine's side of many devices: join the job, agree on the KV budget, take the leader's or a
follower's role (deepinfer/parallel/, docs/parallelism.md). Nothing here runs in one process."""

from __future__ import annotations

import atexit
import logging

from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError

logger = logging.getLogger("deepinfer")


def parallel_refusals(cfg: EngineConfig) -> list[str]:
    """What cannot run with several ranks yet, each with its reason (checked on every rank alike)."""
    reasons = []
    layout = cfg.parallel_layout()
    if cfg.spec_method() and layout.data_parallel_size > 1:  # (context parallelism: cp_forward.py refuses it)
        reasons.append("speculative decoding (speculative_method / DEEPINFER_ENABLE_MTP_VARLEN) with data-parallel "
                       "replicas: a replica's speculative step runs several forwards (verify, MTP pass, chain) whose "
                       "collectives (the MoE layers' under expert parallelism) the other replicas' steps would not "
                       "meet, and the replicas' speculation statistics are not merged; it runs with tensor "
                       "parallelism (one replica)")
    if cfg.kv_disk_cache_dir is not None:
        reasons.append("kv_disk_cache_dir: the disk tier's files are per process; several ranks would share "
                       "one directory")
    if cfg.kv_host_cache_gib is not None:
        reasons.append("kv_host_cache_gib: the host tier is not proven with several ranks (each would keep "
                       "its own copy of the replicated latent cache)")
    return reasons


def shape_refusals(cfg: EngineConfig, hf_config: dict) -> list[str]:
    """Splits the checkpoint's shapes do not allow, found before any process is spawned."""
    layout = cfg.parallel_layout()
    tp, reasons = layout.tensor_parallel_size, []
    heads = hf_config.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        reasons.append(f"tensor_parallel_size={tp} does not divide the model's {heads} attention heads")
    experts = hf_config.get("n_routed_experts")
    if layout.enable_expert_parallel and isinstance(experts, int):
        slots = experts + cfg.eplb_num_redundant_experts
        if slots % layout.world_size:
            reasons.append(f"enable_expert_parallel: {experts} routed experts + eplb_num_redundant_experts="
                           f"{cfg.eplb_num_redundant_experts} do not split evenly over {layout.world_size} ranks")
    return reasons


def join_parallel_job(cfg: EngineConfig, backend, hf_config: dict):
    """None in one process; else this rank's ParallelJob with the backend's communicators installed.

    A launcher of another node's ranks (node_rank > 0, spawned mode) never returns: it waits for its
    ranks and exits with their status."""
    from deepinfer.parallel.launch import join_job, wait_for_children, wants_parallel

    if not wants_parallel(cfg):
        return None
    from deepinfer.parallel.cp_forward import context_parallel_refusals

    reasons = parallel_refusals(cfg) + shape_refusals(cfg, hf_config) + context_parallel_refusals(cfg, hf_config,
                                                                                                backend.caps)
    layout = cfg.parallel_layout()
    if layout.data_parallel_size > 1 and layout.enable_expert_parallel and backend.caps.graph_capture \
            and not cfg.enforce_eager:
        reasons.append("decode graphs with data-parallel replicas under expert parallelism: the MoE layers gather "
                       "the replicas' token counts on the host inside the forward, which a captured graph cannot "
                       "hold; set enforce_eager=True (--enforce-eager)")
    if layout.enable_expert_parallel and backend.caps.graph_capture and not cfg.enforce_eager and (
            cfg.ep_dispatch == "all_to_all" or (cfg.ep_dispatch == "auto"
                                                and cfg.max_num_seqs >= cfg.ep_all_to_all_min_tokens)):
        reasons.append(f"decode graphs with ep_dispatch={cfg.ep_dispatch!r}: the all-to-all dispatch reads its "
                       "split sizes on the host inside the forward, which a captured graph cannot hold; set "
                       "enforce_eager=True (--enforce-eager), ep_dispatch='all_gather', or (auto) "
                       "ep_all_to_all_min_tokens above max_num_seqs")
    if reasons:
        layout = cfg.parallel_layout()
        raise ConfigError(f"{layout.describe()} cannot run this configuration:\n  - " + "\n  - ".join(reasons))
    job = join_job(cfg, backend.caps.device_type)
    if job.launcher_only:
        raise SystemExit(wait_for_children(job))
    import datetime

    from deepinfer.parallel.groups import build_communicators, build_cp_communicator

    timeout = datetime.timedelta(seconds=job.timeout_s)
    backend.install_communicators(build_communicators(job.layout, job.rank, backend, timeout))
    job.cp_communicator = build_cp_communicator(job.layout, job.rank, backend, timeout)
    logger.info("rank %d of %s (tp rank %d, dp rank %d)", job.rank, job.layout.describe(), job.coords.tp_rank,
                job.coords.dp_rank)
    return job


def agree_kv_budget(job, budget: int) -> int:
    """Every rank sizes its KV cache alike (the schedulers of a replica must admit the same sequences):
    the smallest budget of all ranks."""
    if job is None:
        return budget
    import torch
    import torch.distributed as dist

    t = torch.tensor([budget], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=job.startup_group)
    return int(t.item())


def make_balancer(cfg: EngineConfig, model, backend, job):
    """EPLB's handle on the model (enable_eplb with expert parallelism), else None; on every rank alike."""
    if job is None or not cfg.enable_eplb:
        return None
    from deepinfer.parallel.eplb import ExpertBalancer

    return ExpertBalancer(model, backend, num_redundant=cfg.eplb_num_redundant_experts,
                          step_interval=cfg.eplb_step_interval)


def start_parallel_role(engine, job) -> None:
    """Wire the replica sync, then be the leader (return) or a follower (serve, then exit)."""
    from deepinfer.models.layers.ep_all_to_all import EPDispatch, idle_forward, set_ep_dispatch
    from deepinfer.parallel.driver import LeaderDriver, run_follower

    layout = job.layout
    if layout.enable_expert_parallel:  # how the MoE layers move tokens (models/layers/ep_all_to_all.py)
        set_ep_dispatch(engine.model, EPDispatch(engine.config.ep_dispatch, engine.config.ep_all_to_all_min_tokens))
    if layout.context_parallel_size > 1:
        from deepinfer.parallel.cp_forward import ContextParallelForward

        engine.runner.context_parallel = ContextParallelForward(engine.model, job.cp_communicator,
                                                                engine.config.cp_min_prefill_tokens)
    if layout.enable_expert_parallel and layout.data_parallel_size > 1:
        from deepinfer.parallel.forward_sync import ReplicaForwardSync
        from deepinfer.worker.dummy_forward import DummyForward

        sync = ReplicaForwardSync(engine.backend.communicator("dp"), engine.backend.device)
        block_size = engine.kv.block_size
        dummy = DummyForward(engine.model, block_size, engine.backend.device, engine._kv_layouts)
        engine._pipeline.forward_sync = sync.any_replica_has_work
        # the MoE layers join the collectives with zero tokens then (nothing dispatched or counted for EPLB)
        engine._pipeline.dummy_forward = idle_forward(engine.model, dummy.run)
    import torch.distributed as dist

    dist.barrier(group=job.startup_group)  # every rank built its engine: from here on steps time out fast
    if job.is_leader:
        engine._leader = LeaderDriver(engine, job)
        atexit.register(engine.shutdown)
        return
    run_follower(engine, job)
    raise SystemExit(0)


def abandon_job(job) -> None:
    """Start-up failed on this rank after the job formed: stop the ranks it spawned and leave the group."""
    from deepinfer.parallel.launch import leave_job

    job.stop_children(grace_s=5.0)
    leave_job(job)
