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
