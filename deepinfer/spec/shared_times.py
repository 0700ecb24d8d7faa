"""The adaptive scheduler's measured times, one value on every rank of a tensor-parallel replica.

Why. With tensor parallelism every rank runs the whole runtime over its shard and must schedule the same batches
(docs/parallelism.md "Process model"): its collectives meet only if every rank runs the same forwards. Static k
decides from the drafts alone, identical on every rank. The confidence scheduler (spec/slot_policy.py) also
decides from measured times (the start-up step-cost and drafting tables, each step's wall time, output
processing and drafting time, spec/step_times.py, spec/realized_rates.py), and each rank measures its own: left
alone, the ranks' plans and admissions would part, and so would their batches. So every time the policy reads is
first agreed: tp rank 0's value, broadcast over the "tp" group (`agree`). The ranks then observe the same numbers
in the same order and make the same decisions. On one rank it returns the values unchanged and costs nothing.

Cost: one broadcast of a few floats per adaptive speculative step (gloo on the CPU). On a GPU the values would
travel as a device tensor and `tolist` would wait for it; tensor parallelism does not run on the nvidia backend
yet (max_tensor_parallel_size 1), so that path is not taken today.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedTimes:
    """`agree` over the backend's "tp" communicator, or a pass-through with one rank."""

    comm: object | None = None  # the tp Communicator, None with one rank
    device: torch.device | None = None
    num_agreed: int = 0  # broadcasts made (engine life)

    @classmethod
    def for_backend(cls, backend) -> SharedTimes:
        comm = backend.communicator("tp")
        return cls(comm if comm.world_size > 1 else None, backend.device)

    def agree(self, values: list[float]) -> list[float]:
        """tp rank 0's values, on every rank (every rank calls it at the same point, with as many values)."""
        if self.comm is None or not values:
            return list(values)
        self.num_agreed += 1
        return self.comm.broadcast(torch.tensor(values, dtype=torch.float64, device=self.device), src=0).tolist()
