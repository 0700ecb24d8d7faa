"""Triton MLA layer (KV write + varlen prefill on a cached prefix + split-KV absorbed decode) vs the native op."""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import DEVICE, backend, rel_err, tol  # noqa: I001  (sets TRITON_INTERPRET)

from deepinfer.backend import MLASpec
from deepinfer.backend.forward_batch import ForwardBatch
from deepinfer.backend.native import NativeOps

SPEC = MLASpec(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=32,
               softmax_scale=0.17)
PAGE = 4


def make_batch(ctx: list[int], qlen: list[int], num_blocks: int, g: torch.Generator) -> ForwardBatch:
    seq = [c + q for c, q in zip(ctx, qlen)]
    max_blocks = max(-(-s // PAGE) for s in seq)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seq), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq):
        n = -(-s // PAGE)
        table[i, :n] = perm[used : used + n].int()
        used += n
    positions, slots = [], []
    for i, (c, q) in enumerate(zip(ctx, qlen)):
        for p in range(c, c + q):
            positions.append(p)
            slots.append(int(table[i, p // PAGE]) * PAGE + p % PAGE)
    qsl = [0]
    for q in qlen:
        qsl.append(qsl[-1] + q)
    t = sum(qlen)
    return ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(positions, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
        block_tables={"mla": table.to(DEVICE)},
        slot_mapping={"mla": torch.tensor(slots, device=DEVICE)},
        logits_indices=torch.tensor([x - 1 for x in qsl[1:]], device=DEVICE),
        query_lens_cpu=list(qlen), seq_lens_cpu=seq, context_lens_cpu=list(ctx), block_size=PAGE,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ctx,qlen", [
    ([3, 6, 0, 37], [5, 1, 4, 1]),  # mixed: prefill on a prefix, decode, fresh prefill, long decode
    ([9, 0, 70], [1, 1, 1]),  # decode only (the graph-captured path), split-KV over 70 tokens
])
def test_mla_layer_matches_native(dtype, ctx, qlen):
    g = torch.Generator().manual_seed(5)
    num_blocks = 40
    batch = make_batch(ctx, qlen, num_blocks, g)
    t = sum(qlen)
    s = SPEC
    kv_b = (torch.randn(s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank, generator=g) / 6)
    q = torch.randn(t, s.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim, generator=g)
    kv_c = torch.randn(t, s.kv_lora_rank, generator=g)
    k_pe = torch.randn(t, s.qk_rope_head_dim, generator=g)
    cache = torch.randn(num_blocks, PAGE, s.cache_entry_dim, generator=g)  # stands for the cached prefixes
    to = dict(device=DEVICE, dtype=dtype)
    cache_t, cache_n = cache.to(**to), cache.to(**to)

    ours = backend().make_mla_attention(s)
    ours.load_kv_b_proj(kv_b.to(**to))
    ref = NativeOps().make_mla_attention(s)
    ref.load_kv_b_proj(kv_b.to(**to))
    out = ours.forward(q.to(**to), kv_c.to(**to), k_pe.to(**to), cache_t, batch, "mla")
    exp = ref.forward(q.to(**to), kv_c.to(**to), k_pe.to(**to), cache_n, batch, "mla")
    assert torch.equal(cache_t, cache_n)
    assert out.shape == (t, s.num_heads * s.v_head_dim) and out.dtype == dtype
    assert rel_err(out, exp) < 5 * tol(dtype)


@pytest.mark.parametrize("splits", [1, 2, 7])
def test_mla_decode_kernel_split_invariant_and_deterministic(splits):
    from deepinfer.backends.nvidia.mla_decode import mla_decode

    g = torch.Generator().manual_seed(6)
    L, R = 32, 16
    cache = torch.randn(12, PAGE, L + R, generator=g).to(DEVICE)
    table = torch.randperm(12, generator=g)[:12].view(2, 6).int().to(DEVICE)
    seq = torch.tensor([23, 2], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 3, L + R, generator=g).to(DEVICE)
    out = mla_decode(q, cache, table, seq, L, 0.2, num_splits=splits, block_n=16)
    again = mla_decode(q, cache, table, seq, L, 0.2, num_splits=splits, block_n=16)
    assert torch.equal(out, again)
    for b in range(2):
        n = int(seq[b])
        pos = torch.arange(n, device=DEVICE)
        kv = cache.view(-1, L + R)[table[b][pos // PAGE].long() * PAGE + pos % PAGE]
        exp = ((q[b] @ kv.T) * 0.2).softmax(-1) @ kv[:, :L]
        assert rel_err(out[b], exp) < 1e-5


def test_prefill_attention_head_dim_split():
    """192 = 128 + 64 style split of a non-power-of-two head dim (here 24 = 16 + 8, padded to 16)."""
    from deepinfer.backends.nvidia.prefill_attention import prefill_attention

    g = torch.Generator().manual_seed(7)
    ql, kl = [5, 17], [9, 17]
    q = torch.randn(sum(ql), 2, 24, generator=g).to(DEVICE)
    k = torch.randn(sum(kl), 2, 24, generator=g).to(DEVICE)
    v = torch.randn(sum(kl), 2, 16, generator=g).to(DEVICE)
    cq = torch.tensor([0, 5, 22], dtype=torch.int32, device=DEVICE)
    ck = torch.tensor([0, 9, 26], dtype=torch.int32, device=DEVICE)
    out = prefill_attention(q, k, v, cq, ck, 17, 0.3)
    for i in range(2):
        qi, ki, vi = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        s = torch.einsum("qhd,khd->hqk", qi, ki) * 0.3
        ctx = kl[i] - ql[i]
        mask = torch.arange(kl[i], device=DEVICE)[None, :] <= ctx + torch.arange(ql[i], device=DEVICE)[:, None]
        exp = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), vi)
        assert rel_err(out[cq[i]:cq[i + 1]], exp) < 1e-5


def test_short_extend_over_long_context_runs_as_decode_rows(monkeypatch):
    """A 6-token extend over 300 cached tokens takes the absorbed decode path (token j = a decode row of
    seq_len 300 + j + 1) and matches the native op and the up-projecting prefill path; a fresh prefill, a
    decode row and an extend over a short prefix in the same batch keep their paths."""
    from deepinfer.backends.nvidia import mla_attention as ma

    ctx, qlen = [300, 0, 280, 9], [6, 5, 1, 3]
    assert [ma.extend_as_decode(q, c, 64) for c, q in zip(ctx, qlen)] == [True, False, False, False]
    assert not ma.extend_as_decode(6, 300, 0)  # the knob at 0 turns the path off
    g = torch.Generator().manual_seed(8)
    num_blocks = 160
    batch = make_batch(ctx, qlen, num_blocks, g)
    t = sum(qlen)
    s = SPEC
    kv_b = (torch.randn(s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank, generator=g) / 6)
    q = torch.randn(t, s.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim, generator=g)
    kv_c = torch.randn(t, s.kv_lora_rank, generator=g)
    k_pe = torch.randn(t, s.qk_rope_head_dim, generator=g)
    cache = torch.randn(num_blocks, PAGE, s.cache_entry_dim, generator=g)
    ours = backend().make_mla_attention(s)
    ours.load_kv_b_proj(kv_b.to(DEVICE))
    ref = NativeOps().make_mla_attention(s)
    ref.load_kv_b_proj(kv_b.to(DEVICE))
    calls = []
    real_decode = ours.decode
    monkeypatch.setattr(ours, "decode", lambda q_, *a, **k: calls.append(q_.shape[0]) or real_decode(q_, *a, **k))
    out = ours.forward(q.to(DEVICE), kv_c.to(DEVICE), k_pe.to(DEVICE), cache.clone().to(DEVICE), batch, "mla")
    assert sorted(calls) == [1, 6]  # the decode row, then the extend's 6 rows in one decode call
    exp = ref.forward(q.to(DEVICE), kv_c.to(DEVICE), k_pe.to(DEVICE), cache.clone().to(DEVICE), batch, "mla")
    assert rel_err(out, exp) < 5 * tol(torch.float32)
    monkeypatch.setenv("DEEPINFER_MLA_EXTEND_AS_DECODE_MAX_QUERY", "0")
    calls.clear()
    up = ours.forward(q.to(DEVICE), kv_c.to(DEVICE), k_pe.to(DEVICE), cache.clone().to(DEVICE), batch, "mla")
    assert calls == [1]
    assert rel_err(out, up) < 5 * tol(torch.float32)


def test_mixed_step_plan_is_built_once_per_batch_and_a_replaced_batch_starts_empty():
    """Every layer of a mixed step shares one StepPlan (ForwardBatch.memo); dataclasses.replace gives the copy
    an empty memo, so a plan never outlives the fields it was derived from."""
    import dataclasses

    from deepinfer.conformance.layer_cases import _mla_batch
    from deepinfer.backends.nvidia.mla_attention import StepPlan

    g = torch.Generator().manual_seed(0)
    qlen, ctx = [4, 1, 3], [2, 9, 0]
    num_blocks = sum(-(-(c + n) // 4) for c, n in zip(ctx, qlen)) + 1
    batch = _mla_batch(qlen, ctx, 4, num_blocks, g)
    cache = torch.randn(num_blocks, 4, SPEC.cache_entry_dim, generator=g).to(DEVICE)
    op = backend().make_mla_attention(SPEC)
    op.load_kv_b_proj((torch.randn(SPEC.num_heads * (SPEC.qk_nope_head_dim + SPEC.v_head_dim), SPEC.kv_lora_rank,
                                   generator=g) / 6).to(DEVICE))
    q = torch.randn(sum(qlen), SPEC.num_heads, SPEC.qk_nope_head_dim + SPEC.qk_rope_head_dim, generator=g).to(DEVICE)
    first = op._attend(q, cache, batch, "mla")
    plans = [v for v in batch.derived.values() if isinstance(v, StepPlan)]
    assert len(batch.derived) == 1 and len(plans) == 1
    assert torch.equal(op._attend(q, cache, batch, "mla"), first) and batch.derived[next(iter(batch.derived))] is plans[0]
    copy = dataclasses.replace(batch)
    assert copy.derived == {}
    assert torch.equal(op._attend(q, cache, copy, "mla"), first) and len(copy.derived) == 1
