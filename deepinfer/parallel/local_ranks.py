"""Run a function on N local ranks of a fresh torch.distributed group: the collectives' conformance check,
the tests of every parallel layout, and `deepinfer check --world-size N` use it.

Each rank is a process started by a fork server (multiprocessing's "forkserver": a clean single-threaded
process that imported torch once, then forks a rank per request; never a fork of the caller, whose torch
may hold threads that deadlock a fork) where the platform has one, else spawned. Starting from the fork
server saves every rank the import of torch (seconds each on a busy machine: 4 ranks spent 20 s importing
it on CI's 2 cores). A rank starts with the caller's current environment, working directory and sys.path
(sent along, since the fork server keeps the ones it started with; fn and args are unpickled after them).
It joins a TCP rendezvous on a free loopback port, calls `fn(rank, world_size, *args)` and sends back its
return value (picklable) or its exception text. The parent waits at most `timeout_s` in all, then kills every
rank still alive: a hang is an error naming the ranks that did not finish, never a stuck test run. Once one
rank has failed the others get `grace_s` more (they are usually stuck in a collective the failed rank never
joined), so one rank's error ends the run in seconds, not at the deadline.

Results travel as pickled bytes: a tensor put on a multiprocessing queue as it is would be shared through a
file descriptor its exiting rank closes (the parent then waits for it forever).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from deepinfer.errors import DeepInferError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankFailure:
    rank: int
    error: str


# imported once, by the fork server ("__main__": the caller's script, as multiprocessing does by default).
# torch only, the costly part: deepinfer's own modules are imported by each rank, so a rank runs the code on
# disk now, as a spawned one would, not the code of when the server started.
PRELOAD = ["__main__", "torch", "torch.distributed"]


def start_context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first run)
        return ctx
    return mp.get_context("spawn")


def _rank_main(call: bytes, rank: int, world_size: int, port: int, dist_backend: str, timeout_s: float,
               env: dict[str, str], cwd: str, path: list[str], queue) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    try:
        import datetime

        import torch
        import torch.distributed as dist

        fn, args = pickle.loads(call)  # here: its module may need the sys.path set above
        torch.set_num_threads(1)  # N ranks share the machine's cores
        dist.init_process_group(dist_backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - the parent reports it with the rank
        queue.put((rank, False, traceback.format_exc()))


def run_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, dist_backend: str = "gloo",
                    timeout_s: float = 120.0, env: dict[str, str] | None = None, grace_s: float = 10.0) -> list[Any]:
    """fn's return value on every rank, in rank order; DeepInferError naming the failed or stuck ranks.

    fn must be a module-level function (it is pickled into the rank processes). env: variables set on top
    of this process's environment in every rank.
    """
    ctx = start_context()
    queue = ctx.Queue()
    port = free_port()
    rank_env = {**os.environ, **(env or {})}
    call = pickle.dumps((fn, args))
    procs = [ctx.Process(target=_rank_main, args=(call, r, world_size, port, dist_backend, timeout_s,
                                                  rank_env, os.getcwd(), list(sys.path), queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = queue.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check for ranks that died without reporting
                done = {f.rank for f in failures} | set(results)
                for r, p in enumerate(procs):
                    if r not in done and not p.is_alive() and p.exitcode not in (0, None):
                        failures.append(RankFailure(r, f"exited with code {p.exitcode} without a result"))
                        deadline = min(deadline, time.monotonic() + grace_s)
                continue
            if ok:
                results[rank] = pickle.loads(value)
            else:
                failures.append(RankFailure(rank, value))
                deadline = min(deadline, time.monotonic() + grace_s)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    missing = [r for r in range(world_size) if r not in results and r not in {f.rank for f in failures}]
    if failures or missing:
        lines = [f"rank {f.rank}: {f.error.strip()}" for f in sorted(failures, key=lambda f: f.rank)]
        if missing:
            why = f"within {timeout_s:.0f} s" if not failures else f"within {grace_s:.0f} s of the first failure"
            lines.append(f"ranks {missing} did not finish {why} (killed)")
        raise DeepInferError(f"{len(failures) + len(missing)} of {world_size} ranks failed:\n" + "\n".join(lines))
    return [results[r] for r in range(world_size)]
