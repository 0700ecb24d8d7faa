"""How a DeepSeek-V4 attention layer splits over the tensor-parallel ranks (docs/parallelism.md).

Split with the heads (rank r holds heads [r * H/tp, (r + 1) * H/tp)): the q up-projection's rows
(`wq_b`), the per-head attention sinks, and the grouped output projection by whole groups: heads are laid
out group after group, so rank r's heads fill groups [r * G/tp, (r + 1) * G/tp); `wo_a` is column-split by
those groups' rows and `wo_b` row-split by their columns, whose partial sums are the layer's one all-reduce.

Replicated (every rank computes them whole): the q down-projection and its norm (`wq_a`, `q_norm`: every
head reads them), the one shared KV head (`wkv`, `norm`), the compressors (they build the compressed
entries of that shared head, which every head attends to) and the lightning indexer (its heads score the
compressed entries for ONE top-k selection shared by all attention heads: splitting its heads would need an
all-reduce of the [tokens, entries] scores before the top-k, for a projection far smaller than the heads').
So the KV cache (sliding-window keys, compressed entries, indexer keys, compressor rings) is the same on
every rank, as the MLA latent cache of V2 / V3.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.backend import Communicator
from deepinfer.errors import ConfigError
from deepinfer.models.deepseek_v4.config import DeepseekV4Config


@dataclass(frozen=True)
class HeadShard:
    """This rank's attention heads and output groups (one rank: all of them)."""

    rank: int
    size: int
    heads: int  # local heads
    groups: int  # local o_groups

    @property
    def first_head(self) -> int:
        return self.rank * self.heads


def head_shard(cfg: DeepseekV4Config, tp: Communicator) -> HeadShard:
    """The split of `cfg`'s heads over `tp`; an uneven split is an error naming the setting."""
    n, H, G = tp.world_size, cfg.num_attention_heads, cfg.o_groups
    if H % n:
        raise ConfigError(f"num_attention_heads {H} does not split evenly over tensor_parallel_size {n} "
                          "(DeepSeek-V4 attention heads are split over the tensor-parallel ranks)")
    if G % n:
        raise ConfigError(f"o_groups {G} does not split evenly over tensor_parallel_size {n} (the grouped output "
                          "projection is split by whole groups, so each rank's heads must fill whole groups)")
    return HeadShard(rank=tp.rank, size=n, heads=H // n, groups=G // n)
