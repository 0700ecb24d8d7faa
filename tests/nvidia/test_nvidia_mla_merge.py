"""The MLA split-KV merge run inside the split kernel (the last split of a row merges) vs the separate
merge kernel and a float64 reference: same values, deterministic, padded rows zero, counters reset."""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import DEVICE, ON_GPU, mla_decode_ref, rel_err  # noqa: I001  (sets TRITON_INTERPRET)

PAGE = 4


def _inputs(heads: int, seq: list[int], dtype: torch.dtype, seed: int, L: int = 32, R: int = 16, page: int = PAGE):
    g = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // page) for n in seq))
    blocks = width * len(seq) + 3
    cache = torch.randn(blocks, page, L + R, generator=g).to(DEVICE, dtype)
    table = torch.randperm(blocks, generator=g)[: width * len(seq)].view(len(seq), width).int().to(DEVICE)
    q = torch.randn(len(seq), heads, L + R, generator=g).to(DEVICE, dtype)
    return q, cache, table, torch.tensor(seq, dtype=torch.int32, device=DEVICE)


def _poison_next_output(like: torch.Tensor) -> None:
    """Free a NaN-filled block of the output's size: the allocator hands it to the next output of that
    size, so a padded row the kernel failed to write would show NaN (which would reach the router)."""
    nan = torch.full_like(like, float("nan"))
    del nan


@pytest.mark.parametrize("heads", [5, 20])  # 20: two head blocks, one counter each per row
@pytest.mark.parametrize("splits,min_split", [(2, 16), (4, 16), (7, 32)])
def test_fused_merge_equals_merge_kernel_and_reference(monkeypatch, heads, splits, min_split):
    from deepinfer.backends.nvidia.mla_decode import merge_counters, mla_decode

    dtype = torch.float32
    L = 32
    seq = [45, 3, 0, 17, 64]  # long, one split, padded (length 0), ...
    q, cache, table, seq_t = _inputs(heads, seq, dtype, seed=21)
    kw = dict(num_splits=splits, block_n=16, min_split=min_split)
    monkeypatch.setenv("DEEPINFER_MLA_FUSED_MERGE", "0")
    separate = mla_decode(q, cache, table, seq_t, L, 0.2, **kw)
    monkeypatch.setenv("DEEPINFER_MLA_FUSED_MERGE", "1")
    _poison_next_output(separate)
    fused = mla_decode(q, cache, table, seq_t, L, 0.2, **kw)
    again = mla_decode(q, cache, table, seq_t, L, 0.2, **kw)  # reuses the counters: they were reset
    assert torch.equal(fused, again)
    assert int(merge_counters(DEVICE, 1).abs().sum()) == 0
    assert torch.equal(fused[2].cpu(), torch.zeros_like(fused[2].cpu()))  # the padded row
    assert rel_err(fused.cpu(), separate.cpu()) < 1e-6  # fp32: only the merge's summation tile differs
    exp = mla_decode_ref(q, cache, table, seq_t, L, 0.2)
    assert rel_err(fused.cpu(), exp) < 1e-5


@pytest.mark.skipif(not ON_GPU, reason="real V2-Lite shapes and many launches: GPU only")
@pytest.mark.parametrize("batch,splits,block_n", [(64, 4, 32), (64, 3, 64), (130, 2, 32)])
def test_fused_merge_real_shapes_repeatable(monkeypatch, batch, splits, block_n):
    """16 heads, L 512 + R 64, page 64, mixed lengths up to 2k: the fused merge equals the separate one
    and repeats bit for bit over many launches (the counters' acquire / release ordering holds)."""
    from deepinfer.backends.nvidia.mla_decode import mla_decode

    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 2048, (batch,), generator=g).tolist()
    lens[0] = 0
    q, cache, table, seq_t = _inputs(16, lens, torch.bfloat16, seed=batch, L=512, R=64, page=64)
    kw = dict(num_splits=splits, block_n=block_n, min_split=block_n)
    monkeypatch.setenv("DEEPINFER_MLA_FUSED_MERGE", "0")
    separate = mla_decode(q, cache, table, seq_t, 512, 0.1, **kw)
    monkeypatch.setenv("DEEPINFER_MLA_FUSED_MERGE", "1")
    _poison_next_output(separate)
    first = mla_decode(q, cache, table, seq_t, 512, 0.1, **kw)
    for _ in range(50):
        assert torch.equal(mla_decode(q, cache, table, seq_t, 512, 0.1, **kw), first)
    assert rel_err(first.float(), separate.float()) < 1e-2 / 8  # bf16 output rounding only
    assert torch.equal(first[0], torch.zeros_like(first[0]))


def test_fused_merge_policy(monkeypatch):
    """In-kernel merge up to FUSED_MERGE_MAX_SPLITS launched splits by default; the env forces either way."""
    from deepinfer.backends.nvidia.mla_decode import FUSED_MERGE_MAX_SPLITS, fused_merge_enabled

    monkeypatch.delenv("DEEPINFER_MLA_FUSED_MERGE", raising=False)
    assert fused_merge_enabled(FUSED_MERGE_MAX_SPLITS) and not fused_merge_enabled(FUSED_MERGE_MAX_SPLITS + 1)
    monkeypatch.setenv("DEEPINFER_MLA_FUSED_MERGE", "0")
    assert not fused_merge_enabled(2)
    monkeypatch.setenv("DEEPINFER_MLA_FUSED_MERGE", "1")
    assert fused_merge_enabled(16)
