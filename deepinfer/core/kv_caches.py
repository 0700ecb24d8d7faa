"""The device tensors of the KV cache, handed to the model each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.core.kv_spec import KVCacheSpec


@dataclass
class KVCaches:
    """Per (group, layer) cache tensors and per-sequence state pools.

    kv[(group, layer)]: [num_blocks_of_group, block_size, *entry_shape]
    state[(group, layer)]: [max_num_seqs, *state_shape] (groups with state only)
    """

    specs: dict[str, KVCacheSpec]
    block_size: int
    kv: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    state: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def get(self, group: str, layer_id: int) -> torch.Tensor:
        return self.kv[(group, layer_id)]

    def get_state(self, group: str, layer_id: int) -> torch.Tensor:
        return self.state[(group, layer_id)]

    @classmethod
    def allocate(
        cls,
        specs: list[KVCacheSpec],
        num_blocks: dict[str, int],
        block_size: int,
        max_num_seqs: int,
        device: torch.device,
    ) -> "KVCaches":
        caches = cls(specs={s.name: s for s in specs}, block_size=block_size)
        for s in specs:
            for layer in s.layer_ids:
                caches.kv[(s.name, layer)] = torch.zeros(
                    (num_blocks[s.name], block_size, *s.entry_shape), dtype=s.dtype, device=device
                )
                if s.state_shape:
                    caches.state[(s.name, layer)] = torch.zeros(
                        (max_num_seqs, *s.state_shape), dtype=s.state_dtype, device=device
                    )
        return caches
