"""The batch builder's host twin of the slot rule: `token_slots_host` (numpy, what BatchBuilder.build computes every
step's slot mapping with) == `token_slots` (torch, what the MTP graphs compute on the device), on random tables with
returned window blocks (-1 entries), plain and compressed groups (tokens_per_entry 1 and 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.backend import token_slots, token_slots_host


@pytest.mark.parametrize("m", [1, 4])
def test_token_slots_host_equals_token_slots(m):
    g = torch.Generator().manual_seed(m)
    block_size, rows, width, tokens = 16, 6, 9, 200
    table = torch.randint(0, 500, (rows, width), generator=g, dtype=torch.int32)
    table[torch.rand((rows, width), generator=g) < 0.2] = -1  # window blocks already returned
    req = torch.randint(0, rows, (tokens,), generator=g)
    positions = torch.randint(0, width * block_size * m, (tokens,), generator=g)
    want = token_slots(table, req, positions, m, block_size)
    got = token_slots_host(table.numpy(), req.numpy(), positions.numpy(), m, block_size)
    assert got.dtype == np.int64
    assert torch.equal(torch.from_numpy(got), want)
    assert (want == -1).any() and (want >= 0).any()


@pytest.mark.parametrize("decode_rows", [False, True])
def test_token_fields_lists_and_numpy_agree_with_the_rule(decode_rows):
    """worker/batch_builder.py token_fields: its two strategies (Python lists for small batches, numpy for large)
    give the same positions, token requests and decode-row int32 fields, and those follow the rule (request i's
    tokens at ctx_i .. ctx_i + q_i - 1); int32_words packs lists and arrays into the same words."""
    from deepinfer.worker.batch_builder import int32_views, int32_words, token_fields

    rng = np.random.default_rng(0)
    for _ in range(30):
        b = int(rng.integers(1, 9))
        q = [int(x) for x in rng.integers(1, 7, size=b)]
        c = [int(x) for x in rng.integers(0, 100, size=b)]
        t = sum(q)
        want_pos = [ci + j for qi, ci in zip(q, c) for j in range(qi)]
        want_req = [i for i, qi in enumerate(q) for _ in range(qi)]
        a = token_fields(q, c, t, decode_rows, lists=True)
        n = token_fields(q, c, t, decode_rows, lists=False)
        for got in (a, n):
            assert list(got[0]) == want_pos and list(got[1]) == want_req
            if decode_rows:
                assert [list(f) for f in got[2]] == [list(range(t + 1)), [p + 1 for p in want_pos], want_pos]
            else:
                assert got[2] == []
        if decode_rows:
            wa, wn = int32_words(q, *a[2]), int32_words(q, *n[2])
            assert wa.dtype == wn.dtype == np.int64 and np.array_equal(wa, wn)
            views = int32_views(torch.from_numpy(wn), [b, t + 1, t, t])
            assert [v.tolist() for v in views] == [q, list(range(t + 1)), [p + 1 for p in want_pos], want_pos]
