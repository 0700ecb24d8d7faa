"""Starting the processes of a parallel engine and joining torch.distributed.

Two ways in, one job:
- spawned (one node, the default): the process that builds the engine is global rank 0 (the leader);
  it spawns ranks 1 .. world-1 itself (`multiprocessing` spawn, never fork) and each of them builds the
  same engine as a follower (`follower_main`). With several nodes, node k runs the same command with
  `--node-rank k`: its launcher spawns the node's ranks k*L .. k*L+L-1 (L = world / nnodes) and waits.
- env (torchrun-compatible): RANK, WORLD_SIZE (and MASTER_ADDR, MASTER_PORT, LOCAL_RANK) are set by the
  launcher of every process; nothing is spawned and this process is that rank.

Everyone rendezvous through torch.distributed's env:// TCP store on master_addr:master_port with
EngineConfig.dist_timeout_s as the timeout of the rendezvous and of every collective, so a rank that
never arrives, dies or hangs ends the others with an error instead of a hang. The transport is the
backend's (gloo on the CPU, NCCL for CUDA, HCCL for NPUs); the leader's step commands always travel on
a separate gloo group (driver.py), whatever the devices.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError, DeepInferError
from deepinfer.parallel.layout import ParallelLayout, RankCoords

logger = logging.getLogger("deepinfer")

TRANSPORTS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass
class ParallelJob:
    """This process's place in a parallel engine."""

    layout: ParallelLayout
    coords: RankCoords
    timeout_s: float
    control_group: object = None  # the gloo group of the leader's step commands (dist_timeout_s)
    startup_group: object = None  # the gloo group of start-up agreements (startup_timeout_s)
    startup_timeout_s: float = 600.0  # rendezvous and start-up: ranks load weights at different speeds
    children: list = field(default_factory=list)  # processes this launcher spawned (mp.Process)
    launched_by_env: bool = False
    launcher_only: bool = False  # a node launcher (node_rank > 0): it spawned its ranks and joins no group
    store: object = None  # the rendezvous store the leader hosts when it spawned its ranks
    cp_communicator: object = None  # the "cp" group's Communicator (groups.build_cp_communicator), once joined

    @property
    def rank(self) -> int:
        return self.coords.rank

    @property
    def is_leader(self) -> bool:
        return self.coords.rank == 0

    def dead_children(self) -> list[str]:
        """'rank R (exit code C)' for each spawned rank that is no longer running."""
        out = []
        for rank, proc in self.children:
            if not proc.is_alive():
                out.append(f"rank {rank} (exit code {proc.exitcode})")
        return out

    def stop_children(self, grace_s: float = 10.0) -> None:
        deadline = time.monotonic() + grace_s
        for _, proc in self.children:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for _, proc in self.children:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)


def env_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when a torchrun-style launcher set them, else None."""
    rank, world = envs.DIST_RANK.get(), envs.DIST_WORLD_SIZE.get()
    if rank is None or world is None:
        return None
    return rank, world


def wants_parallel(cfg: EngineConfig) -> bool:
    """Whether this engine is one rank of several (the layout asks for it, or a launcher started it so)."""
    env = env_rank()
    return cfg.parallel_layout().is_parallel or (env is not None and env[1] > 1)


def join_job(cfg: EngineConfig, device_type: str) -> ParallelJob:
    """Spawn this node's other ranks when this process launches them, then join the process group."""
    layout = cfg.parallel_layout()
    world = layout.world_size
    env = env_rank()
    if env is not None:
        rank, env_world = env
        if env_world != world:
            raise ConfigError(f"WORLD_SIZE={env_world} in the environment, but EngineConfig asks for "
                              f"tensor_parallel_size x context_parallel_size x data_parallel_size = {world} "
                              f"processes")
        addr = envs.DIST_MASTER_ADDR.get() or cfg.master_addr
        port = envs.DIST_MASTER_PORT.get() or cfg.master_port or 29500
        job = ParallelJob(layout, layout.coords(rank), float(cfg.dist_timeout_s), launched_by_env=True,
                          startup_timeout_s=max(600.0, float(cfg.dist_timeout_s)))
    else:
        if world % cfg.nnodes:
            raise ConfigError(f"EngineConfig.nnodes={cfg.nnodes} does not divide the {world} processes")
        per_node = world // cfg.nnodes
        if cfg.nnodes > 1 and cfg.master_port is None:
            raise ConfigError("EngineConfig.master_port must be set when nnodes > 1 (every node dials it)")
        addr = cfg.master_addr
        port = cfg.master_port or _free_port()
        first = cfg.node_rank * per_node
        job = ParallelJob(layout, layout.coords(first), float(cfg.dist_timeout_s),
                          startup_timeout_s=max(600.0, float(cfg.dist_timeout_s)))
        # the leader's node: this process is rank 0 and spawns 1 .. L-1; another node: this process only
        # launches its L ranks (all followers) and waits for them (wait_for_children)
        spawn = list(range(1, per_node)) if first == 0 else list(range(first, first + per_node))
        job.children = [(r, _spawn_follower(cfg, r, addr, port, r - first)) for r in spawn]
        if first != 0:
            job.launcher_only = True  # the node launcher joins no group itself (wait_for_children)
            return job
    _init_process_group(job, device_type, addr, port)
    return job


def _free_port() -> int:
    from deepinfer.parallel.local_ranks import free_port

    return free_port()


def _spawn_follower(cfg: EngineConfig, rank: int, addr: str, port: int, local_rank: int):
    """A rank process from the fork server local_ranks.py keeps (torch imported once, never a fork of this
    process), else spawned; it starts with this process's environment, working directory and sys.path."""
    from deepinfer.parallel.local_ranks import start_context

    ctx = start_context()
    here = (dict(os.environ), os.getcwd(), list(sys.path))
    proc = ctx.Process(target=follower_main, args=(cfg, rank, addr, port, local_rank, os.getpid(), here),
                       name=f"deepinfer-rank{rank}", daemon=False)
    proc.start()
    return proc


def _init_process_group(job: ParallelJob, device_type: str, addr: str, port: int) -> None:
    import torch.distributed as dist

    transport = TRANSPORTS.get(device_type)
    if transport is None:
        raise ConfigError(f"no torch.distributed transport for device type {device_type!r} "
                          f"(known: {', '.join(f'{k} -> {v}' for k, v in TRANSPORTS.items())})")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    startup = datetime.timedelta(seconds=job.startup_timeout_s)
    try:
        if job.rank == 0 and job.children:
            # the leader that spawned ranks hosts the rendezvous store itself, so it can watch them while it
            # waits: one that dies before arriving (a bad device, an import error, the OOM killer) ends the
            # start-up at once, naming it, instead of after the whole start-up timeout
            store = dist.TCPStore(addr, port, job.layout.world_size, is_master=True, timeout=startup,
                                  wait_for_workers=False, multi_tenant=True)
            _wait_for_arrivals(job, store)
            job.store = store  # the process group reads it; kept alive with the job
            dist.init_process_group(transport, store=dist.PrefixStore("default_pg", store), rank=0,
                                    world_size=job.layout.world_size, timeout=startup)
        else:
            if job.rank != 0:
                _announce_arrival(addr, port, startup)
            dist.init_process_group(transport, init_method=f"tcp://{addr}:{port}", rank=job.rank,
                                    world_size=job.layout.world_size, timeout=startup)
    except DeepInferError:
        job.stop_children(grace_s=0.0)
        raise
    except Exception as exc:
        job.stop_children(grace_s=0.0)
        raise DeepInferError(f"rank {job.rank}: joining the {job.layout.world_size}-process group at "
                             f"{addr}:{port} failed within {job.startup_timeout_s:g} s: {exc}") from exc
    everyone = list(range(job.layout.world_size))
    # start-up collectives (loading can take minutes on some ranks) wait the start-up timeout; every step's
    # collective waits dist_timeout_s
    job.startup_group = dist.new_group(everyone, backend="gloo", timeout=startup)
    job.control_group = dist.new_group(everyone, backend="gloo", timeout=datetime.timedelta(seconds=job.timeout_s))


ARRIVED_KEY = "deepinfer/ranks_arrived"  # every rank but 0 adds 1 right before joining the process group


def _announce_arrival(addr: str, port: int, timeout: datetime.timedelta) -> None:
    """Tell the leader's store this rank is about to join (a harmless key in any other store, torchrun's too)."""
    import torch.distributed as dist

    client = dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)
    client.add(ARRIVED_KEY, 1)


def _wait_for_arrivals(job: ParallelJob, store) -> None:
    """Until every other rank has announced itself; DeepInferError at once when a spawned rank died first,
    or after the start-up timeout."""
    others = job.layout.world_size - 1
    deadline = time.monotonic() + job.startup_timeout_s
    while store.add(ARRIVED_KEY, 0) < others:
        dead = job.dead_children()
        if dead:
            raise DeepInferError(f"rank 0: {', '.join(dead)} stopped before joining the "
                                 f"{job.layout.world_size}-process group (see its log above)")
        if time.monotonic() > deadline:
            raise DeepInferError(f"rank 0: {store.add(ARRIVED_KEY, 0)} of the other {others} ranks reached the "
                                 f"rendezvous within {job.startup_timeout_s:g} s")
        time.sleep(0.05)


def leave_job(job: ParallelJob) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone: nothing left to tear down cleanly
            logger.debug("destroy_process_group failed on rank %d", job.rank, exc_info=True)


def _watch_parent(parent_pid: int) -> None:
    """A spawned rank whose launcher died (killed, crashed) exits too, instead of waiting on a dead job.
    (The launcher is not this process's parent when a fork server started it: probe its pid.)"""
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            logger.error("deepinfer rank: the launcher (pid %d) is gone; exiting", parent_pid)
            os._exit(3)
        except PermissionError:  # a pid reused by another user's process: ours is gone
            os._exit(3)


def follower_main(cfg: EngineConfig, rank: int, addr: str, port: int, local_rank: int, parent_pid: int,
                  here: tuple[dict, str, list] | None = None) -> None:
    """A spawned rank: build the engine as a follower and serve the leader's steps until it says stop."""
    if here is not None:  # the launcher's environment, directory and import path (a fork server has its own)
        env, cwd, path = here
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(cfg.parallel_layout().world_size),
                       "LOCAL_RANK": str(local_rank), "MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    from deepinfer.engine.llm_engine import DeepInferenceEngine

    try:
        engine = DeepInferenceEngine(cfg)  # a follower: returns after the leader's stop
    except SystemExit:
        raise
    except BaseException:
        logger.exception("deepinfer rank %d failed", rank)
        os._exit(1)
    del engine


def wait_for_children(job: ParallelJob) -> int:
    """A node launcher (node_rank > 0): wait for its ranks; 0 when all ended cleanly."""
    codes = []
    for _, proc in job.children:
        proc.join()
        codes.append(proc.exitcode or 0)
    return max(codes, default=0)
