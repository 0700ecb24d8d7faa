"""Which rank does what: tensor-parallel x context-parallel x data-parallel ranks, experts over the
expert-parallel group.

Rank r of a world of tp * cp * dp processes has coordinates r = (dp_rank * cp + cp_rank) * tp + tp_rank:
the ranks of one data-parallel replica (its cp * tp ranks) are consecutive, and so are the tp ranks of one
tensor-parallel group inside it, so a tensor-parallel group stays inside one node when tp divides the
node's devices (as vLLM and SGLang lay them out). With cp = 1 (the default) this is r = dp_rank * tp +
tp_rank.

- "tp" group: the tp ranks of one replica. Attention heads, the dense MLPs, the shared experts and the
  vocabulary are split over it; every rank of it sees the same tokens.
- "dp" group: the dp ranks with the same tp_rank. Each replica schedules its own requests (data-parallel
  attention); without expert parallelism the replicas share nothing.
- "ep" group: with enable_expert_parallel, all tp * dp ranks; the routed experts are spread over it (whole
  experts per rank) and a MoE layer sees the tokens of every replica. Without it, the routed experts are
  split like the dense MLPs (intermediate dimension over "tp") and "ep" is a group of one.
- "cp" group: the cp ranks of one replica with the same tp_rank (context-parallel prefill,
  parallel/context_parallel.py). They hold the same weights and see the same requests; a step with a long
  prefill splits its query tokens over them. context_parallel_size > 1 runs only with tp = dp = 1 and
  without expert parallelism so far (engine/parallel_setup.py refuses the rest at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.errors import ConfigError


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp_rank: int
    dp_rank: int
    cp_rank: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "context_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"EngineConfig.{name} must be an integer >= 1 (got {v!r})")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ConfigError(f"EngineConfig.enable_expert_parallel must be a bool (got {self.enable_expert_parallel!r})")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.context_parallel_size * self.data_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are spread over (1: not spread; split like a dense MLP over tp)."""
        return self.world_size if self.enable_expert_parallel else 1

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the world of {self.world_size} ranks")
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        dp_rank, rest = divmod(rank, tp * cp)
        cp_rank, tp_rank = divmod(rest, tp)
        return RankCoords(rank=rank, tp_rank=tp_rank, dp_rank=dp_rank, cp_rank=cp_rank)

    def _rank(self, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.context_parallel_size + cp_rank) * self.tensor_parallel_size + tp_rank

    def tp_group_ranks(self, dp_rank: int, cp_rank: int = 0) -> list[int]:
        return [self._rank(dp_rank, cp_rank, t) for t in range(self.tensor_parallel_size)]

    def dp_group_ranks(self, tp_rank: int, cp_rank: int = 0) -> list[int]:
        return [self._rank(d, cp_rank, tp_rank) for d in range(self.data_parallel_size)]

    def cp_group_ranks(self, dp_rank: int, tp_rank: int = 0) -> list[int]:
        return [self._rank(dp_rank, c, tp_rank) for c in range(self.context_parallel_size)]

    def all_tp_groups(self) -> list[list[int]]:
        return [self.tp_group_ranks(d, c) for d in range(self.data_parallel_size)
                for c in range(self.context_parallel_size)]

    def all_dp_groups(self) -> list[list[int]]:
        return [self.dp_group_ranks(t, c) for c in range(self.context_parallel_size)
                for t in range(self.tensor_parallel_size)]

    def all_cp_groups(self) -> list[list[int]]:
        return [self.cp_group_ranks(d, t) for d in range(self.data_parallel_size)
                for t in range(self.tensor_parallel_size)]

    def describe(self) -> str:
        ep = f", experts over {self.expert_parallel_size} ranks" if self.enable_expert_parallel else ""
        cp = f" x CP={self.context_parallel_size}" if self.context_parallel_size > 1 else ""
        return (f"TP={self.tensor_parallel_size}{cp} x DP={self.data_parallel_size}{ep} "
                f"({self.world_size} processes)")
