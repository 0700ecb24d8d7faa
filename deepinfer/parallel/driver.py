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
                         engine._local_has_unfinished(), engine._local_stats(), engine._pipeline.has_pending())


def aborted_output(add: AddCommand, last):
    """A remote request's RequestOutput after an abort: its last reported state (or an empty one when no step
    has reported it yet) with every unfinished completion ended by "abort", as the one-process engine gives."""
    import copy

    from deepinfer.outputs import CompletionOutput, RequestOutput

    if last is None:
        n = getattr(add.params, "n", 1)
        last = RequestOutput(add.request_id, add.prompt_text, list(add.prompt_token_ids),
                             [CompletionOutput(i, "", []) for i in range(n)])
    out = copy.deepcopy(last)
    for c in out.outputs:
        if c.finish_reason is None:
            c.finish_reason = "abort"
    out.finished = True
    return out


class LeaderDriver:
    """Rank 0's side: queue what the user asks, broadcast it each step, merge the replicas' outputs."""

    def __init__(self, engine, job: ParallelJob, heartbeat_s: float | None = None):
        self.engine = engine
        self.job = job
        self.channel = ControlChannel(job)
        self.dp = job.layout.data_parallel_size
        self.router = ReplicaRouter(self.dp)
        self.remote: dict[str, int] = {}  # request id -> replica, for requests not on this replica
        self.replica_pending = [False] * self.dp  # a replica's step still in flight (async scheduling), as of its report
        self.replica_stats: dict[int, object] = {}  # the other replicas' EngineStats, as of their last report
        self._ops: list[AddCommand | AbortCommand] = []
        self._remote_adds: dict[str, AddCommand] = {}  # remote requests as the leader prepared them
        self._remote_last: dict[str, object] = {}  # their last RequestOutput the replicas reported
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
        if add.dp_rank == self.job.coords.dp_rank:
            try:  # before the command is queued: a request the leader could not enqueue reaches no follower
                self.engine._enqueue_prepared(add)
            except BaseException:
                self.router.finished(add.request_id)
                raise
        else:
            self.remote[add.request_id] = add.dp_rank
            self._remote_adds[add.request_id] = add
        self._ops.append(add)

    def abort(self, request_id: str):
        """Queue the abort for every rank. For a request on another replica: (True, its last state as one process
        returns it: the completions not finished get finish_reason "abort"); else (False, None)."""
        self._ops.append(AbortCommand(request_id))
        self.router.finished(request_id)
        dp = self.remote.pop(request_id, None)
        add, last = self._remote_adds.pop(request_id, None), self._remote_last.pop(request_id, None)
        if dp is None:
            return False, None
        return True, aborted_output(add, last)

    def has_unfinished(self) -> bool:
        """As one process answers: a request not finished (the leader sees every one enter and leave, so
        `remote` is exact even right after an abort) or a step in flight. A stopped engine raises: it will
        never finish anything, and a caller looping on this (the server) must not spin on a stale True."""
        if self._broken is not None:
            raise DeepInferError(f"the parallel engine stopped: {self._broken}")
        return bool(self.remote) or any(self.replica_pending[d] for d in range(self.dp)
                                        if d != self.job.coords.dp_rank) or self.engine._local_has_unfinished()

    # ------------------------------------------------------------ steps

    def step(self, all_outputs: bool) -> list:
        self.check_usable()
        with self._lock:
            self.check_usable()  # the heartbeat may have found a dead rank while this call waited for the lock
            self._seq += 1
            self.steps += 1  # engine steps (the heartbeat's no-ops are not)
            rebalance = self.engine._eplb_due(self.steps)
            cmd = StepCommand(self._seq, "step", self._ops, all_outputs, rebalance)
            self._ops = []
            # Once the command is out, every rank runs this step: anything raising here on the leader (its own
            # replica's step included, even a DeepInferError) leaves the others in a collective it never joins
            # and its replica's state unlike its followers'. The job cannot go on: stop it, whatever the error.
            try:
                self._send(cmd)
                outputs = self.engine._local_step(all_outputs)
                if rebalance:
                    self.engine._rebalance_experts()
                    self.num_rebalances += 1
                if self.dp > 1:
                    reports = self.channel.gather(replica_report(self.engine, self.job, outputs))
                    outputs = self._merge(outputs, reports)
            except Exception as exc:
                self._fail(exc)
            except BaseException as exc:  # KeyboardInterrupt mid-step: stop every rank, then let it through
                self._stop_job(f"{type(exc).__name__} during a step")
                raise
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
            self.replica_pending[rep.dp_rank] = rep.pending
            self.replica_stats[rep.dp_rank] = rep.stats
            for o in rep.outputs:
                if o.request_id in self.remote:
                    merged.append(o)
                    self._remote_last[o.request_id] = o
            for rid in rep.finished_ids:
                self.remote.pop(rid, None)
                self._remote_adds.pop(rid, None)
                self._remote_last.pop(rid, None)
        return merged

    def _fail(self, exc: BaseException) -> None:
        time.sleep(0.2)  # let a dying rank's exit code be seen
        dead = self.job.dead_children()
        reason = f"{type(exc).__name__}: {exc}"
        if dead:
            reason = f"{', '.join(dead)} stopped ({reason})"
        self._stop_job(reason)
        raise DeepInferError(f"the parallel engine stopped: {reason}") from exc

    def _stop_job(self, reason: str) -> None:
        """The job is over (a rank died or hung, or the ranks left lockstep): stop every spawned rank now and
        leave the process group. Called with the lock held, so no collective of this process is under way."""
        self._broken = reason
        logger.error("parallel engine: %s; stopping every rank", reason)
        self._stop_heartbeat.set()
        self.job.stop_children(grace_s=0.0)
        leave_job(self.job)

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
                # a hung rank would otherwise hold its device (and shutdown wait for it) until the process ends
                self._stop_job(f"a rank stopped answering: {type(exc).__name__}: {exc}")
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
            self.job.stop_children(grace_s=30.0 if self._broken is None else 0.0)  # a broken job got no stop
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
