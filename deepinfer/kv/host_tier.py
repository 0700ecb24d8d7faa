"""The host tier of the prefix cache: evicted KV blocks in host memory, between the device and the disk.

A bounded LRU map from block key to the block's parts: host tensors the link (tier_link.py) filled through the
backend's copy stream (kv/tier_copies.py: pinned buffers on a GPU, so the copies are asynchronous), with the
`ready` callable that waits for that copy (None: filled already). A put beyond the limit pushes the least
recently used blocks out and returns them with their ready, so the link can hand them to the disk tier (whose
writer waits on ready before it reads them). A get refreshes its block. On the CPU the device cache is host
memory already, so this tier only adds a second, larger pool there.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

Ready = Callable[[], None] | None


class HostTier:
    def __init__(self, max_bytes: int, pin: bool = False):
        """pin: pin parts handed in on a device (put copies them down synchronously); parts from the link's
        copies come in host buffers the backend made (pinned on a GPU) and are kept as they are."""
        if max_bytes < 1:
            raise ValueError(f"kv host cache size must be positive, got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.pin = pin
        self._blocks: OrderedDict[bytes, tuple[list[torch.Tensor], Ready]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = self.puts = 0

    @staticmethod
    def _size(parts: list[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in parts)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def put(self, key: bytes, parts: list[torch.Tensor], ready: Ready = None
            ) -> list[tuple[bytes, list[torch.Tensor], Ready]]:
        """Keep the block; return the blocks pushed out to stay within the limit (oldest first)."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return []
        host = [t.detach() if t.device.type == "cpu" else t.detach().to("cpu") for t in parts]
        if self.pin and any(t.device.type != "cpu" for t in parts):
            host = [t.pin_memory() for t in host]
        self._blocks[key] = (host, ready)
        self._bytes += self._size(host)
        self.puts += 1
        out = []
        while self._bytes > self.max_bytes and self._blocks:
            old_key, (old, old_ready) = self._blocks.popitem(last=False)
            self._bytes -= self._size(old)
            out.append((old_key, old, old_ready))
        return out

    def get(self, key: bytes, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The block's host parts (a device copy from them is ordered after their fill on the copy stream)."""
        entry = self._blocks.get(key)
        parts = None if entry is None else entry[0]
        if parts is None or [(t.dtype, t.shape) for t in parts] != [(t.dtype, t.shape) for t in like]:
            self.misses += 1
            return None
        self._blocks.move_to_end(key)
        self.hits += 1
        return parts
