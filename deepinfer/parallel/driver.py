"""The leader / follower step protocol: every rank's engine steps in lockstep with the leader's.

Every rank runs the whole runtime (scheduler, KV manager, sampler) over its shard of the model, as
SGLang's tensor-parallel workers do; what must be the same everywhere is what enters it. So the leader
(global rank 0) alone takes requests from the user, and every step it broadcasts one `StepCommand` on
the control group (gloo, whatever the devices): the requests added since the last step (each with the
seed the leader derived and the data-parallel replica the router picked) and the aborts. Every rank
applies the command, then runs one engine step. The ranks of one replica schedule identical batches
(same inputs, same deterministic scheduler) and sample identical tokens (their logits are gathered over
"tp", so bitwise equal). With several replicas, each replica's tp-rank-0 sends back its outputs
(`gather_object`), and the leader merges them into what its step() returns.

Idle: a follower waits for the next command inside a collective that times out after dist_timeout_s,
so the leader sends a no-op command when it has sent nothing for `heartbeat_s`; a follower whose leader
is gone sees the broadcast fail (connection closed) or time out, and exits. A failed or hung rank makes
the leader's next collective raise (gloo reports the closed connection; a hang hits dist_timeout_s); the
leader then names the spawned ranks that died, stops the rest, and every later call raises.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from deepinfer.errors import DeepInferError
from deepinfer.parallel.commands import AbortCommand, AddCommand, ReplicaReport, StepCommand
from deepinfer.parallel.launch import ParallelJob, leave_job
from deepinfer.parallel.router import ReplicaRouter

logger = logging.getLogger("deepinfer")


class ControlChannel:
    """Python objects between the leader and every rank, on the job's gloo control group."""

    def __init__(self, job: ParallelJob):
        self.group = job.control_group
        self.world = job.layout.world_size
        self.rank = job.rank

    def broadcast(self, obj: Any = None) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list | None:
        import torch.distributed as dist

        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out


def apply_command(engine, cmd: StepCommand, dp_rank: int) -> None:
    for op in cmd.ops:
        if isinstance(op, AbortCommand):
            engine._local_abort(op.request_id)
        elif op.dp_rank == dp_rank:
            engine._enqueue_prepared(op)


def replica_report(engine, job: ParallelJob, outputs: list) -> ReplicaReport | None:
    if job.coords.tp_rank != 0:
        return None
    return ReplicaReport(job.coords.dp_rank, outputs, [o.request_id for o in outputs if o.finished],
                         engine._local_has_unfinished(), engine._local_stats())


class LeaderDriver:
    """Rank 0's side: queue what the user asks, broadcast it each step, merge the replicas' outputs."""

    def __init__(self, engine, job: ParallelJob, heartbeat_s: float | None = None):
        self.engine = engine
        self.job = job
        self.channel = ControlChannel(job)
        self.dp = job.layout.data_parallel_size
        self.router = ReplicaRouter(self.dp)
        self.remote: dict[str, int] = {}  # request id -> replica, for requests not on this replica
        self.replica_busy = [False] * self.dp
        self.replica_stats: dict[int, object] = {}  # the other replicas' EngineStats, as of their last report
        self._ops: list[AddCommand | AbortCommand] = []
        self._seq = 0
        self.steps = 0
        self.num_rebalances = 0
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._broken: str | None = None
        self._closed = False
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else max(0.05, min(2.0, job.timeout_s / 4))
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True, name="deepinfer-heartbeat")
        self._heartbeat.start()

    # ------------------------------------------------------------ requests

    def check_usable(self) -> None:
        if self._broken is not None:
            raise DeepInferError(f"the parallel engine stopped: {self._broken}")
        if self._closed:
            raise DeepInferError("the parallel engine was shut down")

    def add(self, add: AddCommand) -> None:
        """Route the request to a replica; the leader's own replica enqueues it now."""
        self.check_usable()
        add.dp_rank = self.router.pick(add)
        self._ops.append(add)
        if add.dp_rank == self.job.coords.dp_rank:
            self.engine._enqueue_prepared(add)
        else:
            self.remote[add.request_id] = add.dp_rank

    def abort(self, request_id: str) -> bool:
        """Queue the abort for every rank; True if the request lived on another replica."""
        self._ops.append(AbortCommand(request_id))
        dp = self.remote.pop(request_id, None)
        if dp is not None:
            self.router.finished(request_id)
            return True
        self.router.finished(request_id)
        return False

    def has_unfinished(self) -> bool:
        return bool(self.remote) or any(self.replica_busy[d] for d in range(self.dp)
                                        if d != self.job.coords.dp_rank) or self.engine._local_has_unfinished()

    # ------------------------------------------------------------ steps

    def step(self, all_outputs: bool) -> list:
        self.check_usable()
        with self._lock:
            self._seq += 1
            self.steps += 1  # engine steps (the heartbeat's no-ops are not)
            rebalance = self.engine._eplb_due(self.steps)
            cmd = StepCommand(self._seq, "step", self._ops, all_outputs, rebalance)
            self._ops = []
            try:
                self._send(cmd)
                outputs = self.engine._local_step(all_outputs)
                if rebalance:
                    self.engine._rebalance_experts()
                    self.num_rebalances += 1
                if self.dp > 1:
                    reports = self.channel.gather(replica_report(self.engine, self.job, outputs))
                    outputs = self._merge(outputs, reports)
            except DeepInferError:
                raise
            except Exception as exc:
                self._fail(exc)
            for out in outputs:
                if out.finished:
                    self.router.finished(out.request_id)
            return outputs

    def _send(self, cmd: StepCommand) -> None:
        dead = self.job.dead_children()
        if dead:
            raise RuntimeError(f"{', '.join(dead)} stopped")
        self.channel.broadcast(cmd)
        self._last_sent = time.monotonic()

    def _merge(self, local: list, reports: list) -> list:
        mine = self.job.coords.dp_rank
        merged = list(local)
        for rep in reports:
            if rep is None or rep.dp_rank == mine:
                continue
            self.replica_busy[rep.dp_rank] = rep.unfinished
            self.replica_stats[rep.dp_rank] = rep.stats
            merged.extend(o for o in rep.outputs if o.request_id in self.remote)
            for rid in rep.finished_ids:
                self.remote.pop(rid, None)
        return merged

    def _fail(self, exc: BaseException) -> None:
        time.sleep(0.2)  # let a dying rank's exit code be seen
        dead = self.job.dead_children()
        reason = f"{type(exc).__name__}: {exc}"
        if dead:
            reason = f"{', '.join(dead)} stopped ({reason})"
        self._broken = reason
        logger.error("parallel engine: %s; stopping every rank", reason)
        self._stop_heartbeat.set()
        self.job.stop_children(grace_s=0.0)
        leave_job(self.job)
        raise DeepInferError(f"the parallel engine stopped: {reason}") from exc

    def _heartbeat_loop(self) -> None:
        while not self._stop_heartbeat.wait(self.heartbeat_s / 2):
            if time.monotonic() - self._last_sent < self.heartbeat_s:
                continue
            if not self._lock.acquire(blocking=False):
                continue  # a step is being sent: that is the heartbeat
            try:
                if self._broken is None and not self._closed:
                    self._seq += 1
                    self._send(StepCommand(self._seq, "noop"))
            except Exception as exc:  # noqa: BLE001 - reported at the next call
                self._broken = f"a rank stopped answering: {type(exc).__name__}: {exc}"
                logger.error("parallel engine: %s", self._broken)
            finally:
                self._lock.release()

    def shutdown(self) -> None:
        """Tell every rank to stop, wait for the spawned ones, leave the process group."""
        if self._closed:
            return
        self._stop_heartbeat.set()
        with self._lock:
            self._closed = True
            if self._broken is None:
                try:
                    self._seq += 1
                    self._send(StepCommand(self._seq, "stop"))
                except Exception:  # noqa: BLE001 - a rank already gone: stop the rest anyway
                    logger.warning("parallel engine: a rank did not take the stop command", exc_info=True)
            self.job.stop_children(grace_s=30.0)
            leave_job(self.job)


def run_follower(engine, job: ParallelJob) -> None:
    """A follower's life: apply each command, step, report; return at the leader's stop."""
    channel = ControlChannel(job)
    dp_rank = job.coords.dp_rank
    try:
        while True:
            cmd: StepCommand = channel.broadcast()
            if cmd.kind == "noop":
                continue
            if cmd.kind == "stop":
                break
            apply_command(engine, cmd, dp_rank)
            outputs = engine._local_step(cmd.all_outputs)
            if cmd.rebalance:
                engine._rebalance_experts()
            if job.layout.data_parallel_size > 1:
                channel.gather(replica_report(engine, job, outputs))
    finally:
        leave_job(job)
