"""A counter-based random number generator in plain torch integer ops.

Why counter-based: a stateful generator (torch.Generator, curand states) hands out numbers in
the order rows are processed, so a request's draws would depend on which other requests share
its batch, where it sits in the batch and how many numbers they consumed. Here every uniform is
a pure function of (seed, position, token index): the SplitMix64 finaliser of a per-row key plus
the token index. A seeded request therefore draws the same token alone or in any batch, after a
preemption and recompute, and on CPU and CUDA alike (int64 add / mul / xor / shift wrap the
same way on both; only the final fp64 log may differ in the last ulp between devices).
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (odd, 2^64 / golden ratio)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """The int64 two's-complement view of a 64-bit unsigned value (torch has no uint64 math)."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int (exact 64-bit arithmetic)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def derive_seed(base_seed: int, *keys: int) -> int:
    """A new non-negative 63-bit seed from a base seed and integer keys.

    Used for the n > 1 sub-sequences of one request (keys = (index,)) and to give unseeded
    requests a reproducible seed from the engine seed and a request counter.

    Any Python int works: it is read modulo 2**64 (two's complement), so a negative seed is
    fine and every int64 seed gives a different stream; a seed outside int64 would alias one
    inside it, which is why SamplingParams accepts seeds in [-2**63, 2**63 - 1] only.
    """
    h = mix64(int(base_seed) + GOLDEN_GAMMA)
    for k in keys:
        h = mix64(h ^ mix64(int(k) + GOLDEN_GAMMA))
    return h & ((1 << 63) - 1)


def row_key(seed: int, position: int) -> int:
    """The 64-bit stream key of one draw: (seed, position) hashed together."""
    return mix64(mix64(int(seed) + GOLDEN_GAMMA) ^ (int(position) & MASK64))


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic, it copies the sign bit)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on an int64 tensor (wrapping multiply), bit-equal to mix64."""
    z = (z ^ _lsr(z, 30)) * _signed(_M1)
    z = (z ^ _lsr(z, 27)) * _signed(_M2)
    return z ^ _lsr(z, 31)


def splitmix64_tensor(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Raw 64-bit outputs (int64 view): SplitMix64 stream `key`, element `counter` (0-based).

    keys [N, 1] and counters [1, V] (int64) broadcast to [N, V]. Element c of stream k is
    mix64(k + (c + 1) * GOLDEN_GAMMA), exactly what SplitMix64 seeded with k returns on call c+1.
    """
    return mix64_tensor(keys + (counters + 1) * _signed(GOLDEN_GAMMA))


def uniform_tensor(keys: torch.Tensor, num: int) -> torch.Tensor:
    """fp64 uniforms strictly inside (0, 1), shape [N, num], for row keys (int64 [N])."""
    counters = torch.arange(num, dtype=torch.int64, device=keys.device).unsqueeze(0)
    bits = splitmix64_tensor(keys.to(torch.int64).unsqueeze(1), counters)
    top53 = _lsr(bits, 11)  # 53 random bits: exactly representable in fp64
    return (top53.to(torch.float64) + 0.5) * (2.0**-53)


def row_keys_tensor(seeds: list[int], positions: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [N] stream keys for (seed, position) pairs, computed exactly in Python."""
    return torch.tensor([_signed(row_key(s, p)) for s, p in zip(seeds, positions)], dtype=torch.int64, device=device)


def row_keys_device(seeds: list[int], positions: torch.Tensor) -> torch.Tensor:
    """int64 [N] stream keys for (seed, position) pairs with the positions on the device: the seeds' half of row_key
    on the host, the position's on the device (mix64_tensor is bit-equal to mix64, and xor on the int64 view is xor
    on the unsigned bits), so each key equals row_keys_tensor's for the same pair."""
    from deepinfer.worker.transfer import tensor_to

    mixed = tensor_to([_signed(mix64(int(s) + GOLDEN_GAMMA)) for s in seeds], torch.int64, positions.device)
    return mix64_tensor(mixed ^ positions.to(torch.int64))
