"""Which data-parallel replica takes a new request: the least loaded one.

Load is what a replica still owes: for each unfinished request routed to it, its prompt tokens plus its
max_tokens (the work it may still cost; a request without max_tokens counts its prompt twice). The
leader sees every request enter and finish, so it keeps the count without asking the replicas. Ties
go to the lowest replica, so a single request always lands on the leader's replica.
"""

from __future__ import annotations


class ReplicaRouter:
    def __init__(self, num_replicas: int):
        self.loads = [0] * num_replicas
        self._owed: dict[str, tuple[int, int]] = {}  # request id -> (replica, load)

    @staticmethod
    def cost(add) -> int:
        n = len(add.prompt_token_ids)
        max_tokens = getattr(add.params, "max_tokens", None)
        return n + (max_tokens if max_tokens is not None else n)

    def pick(self, add) -> int:
        replica = min(range(len(self.loads)), key=lambda d: (self.loads[d], d))
        load = self.cost(add) * max(1, getattr(add.params, "n", 1))
        self.loads[replica] += load
        self._owed[add.request_id] = (replica, load)
        return replica

    def finished(self, request_id: str) -> None:
        owed = self._owed.pop(request_id, None)
        if owed is not None:
            self.loads[owed[0]] -= owed[1]
