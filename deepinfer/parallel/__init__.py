"""Many devices: the rank layout (tensor x data parallel, experts over all ranks), the torch.distributed
process groups, the launcher (spawned workers or an env-style rendezvous) and the leader / follower step
protocol that keeps every rank's engine in lockstep (docs/parallelism.md)."""

from deepinfer.parallel.layout import ParallelLayout, RankCoords

__all__ = ["ParallelLayout", "RankCoords"]
