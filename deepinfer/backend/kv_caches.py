"""The device tensors of the KV cache, in the layout the backend chooses.

The runtime counts blocks and tokens (kv/); what one block looks like in memory is the
backend's: `Backend.kv_cache_layout(spec)` returns a `KVLayout`, one or more parts per entry
(NVIDIA keeps MLA's latent and rope values in one row of 576; a backend may split them, as
Ascend's fused MLA ops read them from two tensors). Models hand a layer's cache to its op
without looking inside; only the op that the same backend made reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from deepinfer.backend.kv_spec import KVCacheSpec
from deepinfer.errors import BackendError


@dataclass(frozen=True)
class KVPart:
    """One tensor per (group, layer): [num_blocks, block_size, *shape] of `dtype`.

    `order`: None (the default), or a permutation of the last dimension that the part stores, declared
    because a fused operator writes it that way (Ascend's npu_kv_rmsnorm_rope_cache stores MLA's rope
    values de-interleaved): stored[..., j] = entry[..., order[j]]. Only the ops of the backend that
    declared it read the part; `KVLayout.split` / `join` apply and undo it, so a comparison with the
    contract's content (the conformance suite) still checks every value.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.order is not None and sorted(self.order) != list(range(self.shape[-1])):
            raise BackendError(f"KV part {self.name!r}: order must permute its last dimension of {self.shape[-1]}")

    def bytes_per_entry(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class KVLayout:
    """How one KV group's entries are stored: a single part is one tensor (what `KVCaches.get`
    returns); several parts are a tuple of tensors in this order."""

    parts: tuple[KVPart, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise BackendError("a KV layout needs at least one part")

    @classmethod
    def single(cls, spec: KVCacheSpec) -> "KVLayout":
        """The default: each entry one row of spec.entry_shape in spec.dtype."""
        return cls((KVPart("kv", tuple(spec.entry_shape), spec.dtype),))

    @classmethod
    def split_last(cls, spec: KVCacheSpec, sizes: tuple[int, ...], names: tuple[str, ...],
                   orders: tuple[tuple[int, ...] | None, ...] | None = None) -> "KVLayout":
        """The entry's last dimension cut into parts of `sizes` (e.g. MLA latent 512 | rope 64); `orders`:
        per part, None or the permutation it stores (KVPart.order)."""
        *lead, last = spec.entry_shape
        orders = orders or (None,) * len(sizes)
        if sum(sizes) != last or len(sizes) != len(names) or len(orders) != len(sizes):
            raise BackendError(f"KV group {spec.name!r}: cannot split a last dimension of {last} into {sizes}")
        return cls(tuple(KVPart(n, (*lead, k), spec.dtype, o) for n, k, o in zip(names, sizes, orders)))

    @classmethod
    def split_components(cls, spec: KVCacheSpec) -> "KVLayout":
        """One part per component the model declared for the entry (KVCacheSpec.components)."""
        if not spec.components:
            raise BackendError(f"KV group {spec.name!r} declares no components to split its entries into")
        names, sizes = zip(*spec.components)
        return cls.split_last(spec, tuple(sizes), tuple(names))

    def bytes_per_entry(self) -> int:
        """Bytes of one entry of one layer, over all parts."""
        return sum(p.bytes_per_entry() for p in self.parts)

    def split(self, cache: torch.Tensor):
        """A single-tensor cache [num_blocks, block_size, *entry] in this layout (its parts cut along the
        last dimension, as split_last makes them); for tests and the conformance suite."""
        if len(self.parts) == 1:
            return cache if self.parts[0].order is None else cache[..., list(self.parts[0].order)].contiguous()
        sizes = [p.shape[-1] for p in self.parts]
        return tuple((t if p.order is None else t[..., list(p.order)]).contiguous()
                     for p, t in zip(self.parts, cache.split(sizes, dim=-1)))

    def join(self, cache) -> torch.Tensor:
        """The inverse of split: one tensor [num_blocks, block_size, *entry] in the contract's order."""
        tensors = [cache] if len(self.parts) == 1 else list(cache)
        back = [t if p.order is None else t[..., _inverse(p.order)] for p, t in zip(self.parts, tensors)]
        return back[0] if len(back) == 1 else torch.cat(back, dim=-1)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device):
        tensors = tuple(torch.zeros((num_blocks, block_size, *p.shape), dtype=p.dtype, device=device)
                        for p in self.parts)
        return tensors[0] if len(tensors) == 1 else tensors


def _inverse(order: tuple[int, ...]) -> list[int]:
    inv = [0] * len(order)
    for j, i in enumerate(order):
        inv[i] = j
    return inv


@dataclass
class KVCaches:
    """Per (group, layer) cache tensors and per-sequence state pools.

    kv[(group, layer)]: the group's layout allocated for num_blocks blocks (a tensor, or a tuple
    for a layout of several parts); state[(group, layer)]: [max_num_seqs, *state_shape] (groups
    with state only).
    """

    specs: dict[str, KVCacheSpec]
    block_size: int
    layouts: dict[str, KVLayout] = field(default_factory=dict)
    kv: dict[tuple[str, int], object] = field(default_factory=dict)
    state: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def get(self, group: str, layer_id: int):
        """The layer's cache in its group's layout: opaque to everyone but the op that reads it."""
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
        layouts: dict[str, KVLayout] | None = None,
    ) -> "KVCaches":
        """layouts: group -> the backend's layout (`Backend.kv_cache_layout`); None: the single-tensor default."""
        layouts = {s.name: KVLayout.single(s) for s in specs} if layouts is None else dict(layouts)
        caches = cls(specs={s.name: s for s in specs}, block_size=block_size, layouts=layouts)
        for s in specs:
            layout = layouts[s.name]
            for layer in s.layer_ids:
                caches.kv[(s.name, layer)] = layout.allocate(num_blocks[s.name], block_size, device)
                if s.state_shape:
                    caches.state[(s.name, layer)] = torch.zeros(
                        (max_num_seqs, *s.state_shape), dtype=s.state_dtype, device=device
                    )
        return caches
