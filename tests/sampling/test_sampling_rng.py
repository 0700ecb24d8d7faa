"""The counter-based RNG: SplitMix64 bit-exactness, uniform range, seed derivation."""

from __future__ import annotations

import random

import numpy as np
import torch

from deepinfer.sample import rng


def _numpy_mix64(z: np.ndarray) -> np.ndarray:
    """Independent uint64 implementation of SplitMix64's finaliser (numpy wraps uint64)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def test_splitmix64_known_answer():
    # SplitMix64 seeded with 0 (Vigna's reference splitmix64.c): the first three outputs.
    out = rng.splitmix64_tensor(torch.tensor([[0]]), torch.arange(3).unsqueeze(0))
    assert [int(x) & rng.MASK64 for x in out[0]] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_tensor_mix_matches_python_and_numpy():
    r = random.Random(1)
    vals = [r.getrandbits(64) for _ in range(2000)] + [0, 1, rng.MASK64, 1 << 63, (1 << 63) - 1]
    t = torch.tensor([rng._signed(v) for v in vals], dtype=torch.int64)
    got = [int(x) & rng.MASK64 for x in rng.mix64_tensor(t)]
    assert got == [rng.mix64(v) for v in vals]
    ref = _numpy_mix64(np.array(vals, dtype=np.uint64))
    assert got == [int(x) for x in ref]


def test_uniforms_in_open_interval_and_uniform():
    keys = rng.row_keys_tensor([1, 2, 3, 4], [0, 0, 5, 5])
    u = rng.uniform_tensor(keys, 50_000)
    assert u.dtype == torch.float64 and u.shape == (4, 50_000)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.005
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    assert (hist / u.numel() - 0.1).abs().max().item() < 0.005
    # rows are distinct streams
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[2], u[3])


def test_keys_depend_on_seed_and_position_only():
    a = rng.uniform_tensor(rng.row_keys_tensor([7], [3]), 100)
    b = rng.uniform_tensor(rng.row_keys_tensor([9, 7, 7], [3, 3, 4]), 100)
    assert torch.equal(a[0], b[1])
    assert not torch.equal(b[1], b[2]) and not torch.equal(b[0], b[1])
    # a prefix of the counter stream does not depend on how many numbers were asked for
    assert torch.equal(rng.uniform_tensor(rng.row_keys_tensor([7], [3]), 10)[0], a[0, :10])


def test_derive_seed():
    s = rng.derive_seed(1234, 0)
    assert s == rng.derive_seed(1234, 0)
    assert 0 <= s < 2**63
    seeds = {rng.derive_seed(1234, i) for i in range(1000)} | {rng.derive_seed(b) for b in range(1000)}
    assert len(seeds) == 2000
    assert rng.derive_seed(1234) != rng.derive_seed(1234, 0)
    assert 0 <= rng.derive_seed(-5, -1, 2**70) < 2**63



def test_device_keys_equal_host_keys_and_draws():
    """row_keys_device (the seed's half hashed on the host, the position's on the device: a speculative step
    launched before its positions are on the host, spec/chained_steps.py) == row_keys_tensor for the same pairs,
    negative and 64-bit seeds included; so a draw keyed by device positions equals the host-keyed draw, bit for bit."""
    from deepinfer.sample.sampler import gumbel_argmax

    r = random.Random(7)
    seeds = [0, -1, 2**63 - 1, -(2**63), 12345] + [r.randrange(-(2**63), 2**63) for _ in range(27)]
    positions = [0, 1, 2**31, 7, 4096] + [r.randrange(0, 1 << 40) for _ in range(27)]
    want = rng.row_keys_tensor(seeds, positions)
    got = rng.row_keys_device(seeds, torch.tensor(positions, dtype=torch.int64))
    assert torch.equal(got, want)
    shifted = rng.row_keys_device(seeds, torch.tensor(positions, dtype=torch.int64) + 1)
    assert not torch.equal(shifted, want)  # (the key follows the position)
    logits = torch.randn(len(seeds), 50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(gumbel_argmax(logits, seeds, positions),
                       gumbel_argmax(logits, seeds, [0] * len(seeds), torch.tensor(positions)))
