"""The KV decode fast path (try_extend) leaves the same tables as allocate, and falls back when it must."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from deepinfer.backend.kv_spec import KVCacheSpec
from deepinfer.kv.manager import KVCacheManager


@dataclass
class Seq:
    seq_id: str
    num_computed_tokens: int = 0


def _specs(kind: str) -> list[KVCacheSpec]:
    specs = [KVCacheSpec("full", (0,), (1,), torch.float32)]
    if kind == "compressed":
        specs.append(KVCacheSpec("cmp", (1,), (1,), torch.float32, tokens_per_entry=4))
    if kind == "window":
        specs.append(KVCacheSpec("swa", (2,), (1,), torch.float32, sliding_window=6))
    return specs


def _grow(kv: KVCacheManager, seqs: list[Seq], steps: int, fast: bool) -> list[bool]:
    used = []
    for _ in range(steps):
        for s in seqs:
            n = 3 if s.num_computed_tokens == 0 else 1  # a 3-token prompt, then decodes
            ok = fast and kv.try_extend(s, n)
            used.append(ok)
            if not ok:
                assert kv.can_allocate(s, n)
                kv.allocate(s, n)
            s.num_computed_tokens += n
            kv.trim(s)
    return used


@pytest.mark.parametrize("kind", ["full", "compressed", "window"])
def test_fast_path_tables_equal_allocate(kind):
    made = []
    for fast in (False, True):
        kv = KVCacheManager(_specs(kind), {"full": 64, "cmp": 64, "swa": 64}, 4, 4, 64)
        seqs = [Seq(f"s{i}") for i in range(3)]
        used = _grow(kv, seqs, 20, fast)
        made.append((kv, seqs, used))
    (slow, seqs, _), (fast, _, used) = made
    for name in slow.block_tables:
        assert torch.equal(slow.block_tables[name], fast.block_tables[name]), name
        for s in seqs:
            assert slow.block_table(s.seq_id, name) == fast.block_table(s.seq_id, name)
    assert slow.usage_by_group() == fast.usage_by_group()
    if kind == "window":
        assert not any(used)  # sliding groups always take the full path (blocks to trim)
    else:
        assert any(used) and not all(used)  # most decodes need no block; boundaries and admission do


def test_fast_path_refuses_past_max_model_len():
    kv = KVCacheManager(_specs("full"), {"full": 8}, 4, 1, 6)
    s = Seq("a")
    kv.allocate(s, 5)
    s.num_computed_tokens = 5
    assert kv.try_extend(s, 1)  # 6 tokens: still one of the two blocks, within max_model_len
    s.num_computed_tokens = 6
    assert not kv.try_extend(s, 1)  # 7 > max_model_len: allocate must run (and raises)
