"""Free lists of KV blocks (one pool per KV group) and of per-sequence state rows."""

from __future__ import annotations

from collections import deque

from deepinfer.errors import DeepInferError


class BlockPool:
    """Fixed set of block ids 0..num_blocks-1 of one KV group.

    Freed blocks go to the back, allocation takes from the front, so recently
    freed blocks are reused last (cheap insurance against use-after-free bugs).
    """

    def __init__(self, num_blocks: int, name: str = ""):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise DeepInferError(f"KV group {self.name!r}: asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b < 0:
                continue
            if b not in self._used:
                raise DeepInferError(f"KV group {self.name!r}: block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)


class SlotPool(BlockPool):
    """Rows 0..max_num_seqs-1 of the per-sequence state pools (V4 compressor buffers)."""
