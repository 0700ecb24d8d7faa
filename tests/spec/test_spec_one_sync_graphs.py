"""The one-sync step's captured verification (spec/one_sync_graphs.py) against the rule written out on host lists,
over two steps in a row on the same static buffers: the second has fewer verify rows, fewer sequences and a smaller
pass bucket, so the draw's rows, the pass rows and the chain rows past it hold the first step's values. What verify[T]
writes must be the accepted counts and the pass / chain inputs of the step's own rows, and its padded rows must stay
inert (p_row -1, p_ids 0; chain rows below the chain bucket 0, 0, 0); rows past the buckets are never read."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from stand_in_graphs import StandInGraphRunner

from deepinfer.backend.mtp_graph_runner import (
    CHAIN_EXTRA,
    CHAIN_FIELDS,
    PASS_EXTRA,
    PASS_FIELDS,
    MTPGraphRunner,
    MTPStatic,
)
from deepinfer.spec.one_sync_graphs import VerifyGraphs

K = 3


def stand_in_graphs(t_max: int, b_max: int) -> SimpleNamespace:
    """What VerifyGraphs reads of an MTPGraphRunner: its static buffers, pass buckets and graph API."""
    st = MTPStatic.allocate(t_max, b_max, K, 1, torch.float32, torch.device("cpu"))
    api = StandInGraphRunner(model=None, caches=None, block_size=16, max_blocks_per_seq=1, buckets=[],
                             group_names=[])
    return SimpleNamespace(static=st, api=api, pass_buckets=[4, 8, 16])


def stage(st: MTPStatic, drafts: list[list[int]], ctxs: list[int], rows: list[int], rooms: list[int], tb: int,
          cb: int) -> tuple[int, list[int]]:
    """The one-sync prepare's staging of these sequences (spec/one_sync.py); (t, each sequence's first row)."""
    p = {n: [] for n in PASS_FIELDS + PASS_EXTRA}
    starts = []
    for b, (d, c, row) in enumerate(zip(drafts, ctxs, rows)):
        starts.append(len(p["p_pos"]))
        for j in range(1 + len(d)):
            p["p_pos"].append(c + j)
            p["p_row"].append(row)
            p["f_seq"].append(b)
            p["f_j"].append(j)
            p["f_tok"].append(d[j - 1] if j else 0)
    t = len(p["p_pos"])
    p["p_src"], p["p_ids"] = list(range(t)), [0] * t
    c = {"c_src": starts, "c_row": rows, "c_pos": ctxs, "c_len": [K] * len(drafts), "f_start": starts,
         "f_dlen": [len(d) for d in drafts], "f_ctx": ctxs, "f_room": rooms}
    st.write_host(PASS_FIELDS + PASS_EXTRA, [p[n] for n in PASS_FIELDS + PASS_EXTRA], tb)
    st.write_host(CHAIN_FIELDS + CHAIN_EXTRA, [c[n] for n in CHAIN_FIELDS + CHAIN_EXTRA], cb)
    st.ints.copy_(st.host)
    return t, starts


def expect(drafts, ctxs, rows, rooms, chosen: list[int], starts: list[int], t: int, tb: int, cb: int):
    """The rule on host lists: accepted counts, then p_row, p_ids over the pass bucket and c_src, c_pos, c_len,
    c_row over the chain bucket."""
    acc = []
    for d, s in zip(drafts, starts):
        a = 0
        while a < len(d) and chosen[s + a] == d[a]:
            a += 1
        acc.append(a)
    p_row = [-1] * tb
    for b, (d, s, row) in enumerate(zip(drafts, starts, rows)):
        for j in range(acc[b] + 1):
            p_row[s + j] = row
    p_ids = chosen + [0] * (tb - t)
    pad = cb - len(drafts)
    return (acc, p_row, p_ids, [s + a for s, a in zip(starts, acc)] + [0] * pad,
            [c + a for c, a in zip(ctxs, acc)] + [0] * pad,
            [min(K, r - a) for r, a in zip(rooms, acc)] + [0] * pad, rows + [-1] * pad)


def test_verify_graphs_equal_the_rule_and_keep_padded_rows_inert():
    g = stand_in_graphs(16, 8)
    vg = VerifyGraphs.capture(g, torch.device("cpu"))
    st = g.static
    steps = [  # (drafts, contexts, KV rows, rooms, the draw, pass bucket, chain bucket)
        ([[7, 8, 9], [20, 21], [50, 51]], [5, 9, 3], [1, 3, 0], [9, 4, 7],
         [30, 40, 41, 42, 20, 21, 31, 50, 60, 43], 16, 4),  # none, all (room cuts the chain to 2), 1 accepted
        ([[11], [4, 5, 6]], [6, 12], [2, 5], [5, 8], [11, 12, 4, 5, 9, 70], 8, 4),  # 1 (bonus), 2 accepted
    ]
    for drafts, ctxs, rows, rooms, chosen, tb, cb in steps:
        t, starts = stage(st, drafts, ctxs, rows, rooms, tb, cb)
        acc = vg.run(torch.tensor(chosen), tb)[: len(drafts)].tolist()
        want = expect(drafts, ctxs, rows, rooms, chosen, starts, t, tb, cb)
        assert acc == want[0]
        assert st.seg("p_row")[:tb].tolist() == want[1]
        assert st.seg("p_ids")[:tb].tolist() == want[2]
        assert st.seg("c_src")[:cb].tolist() == want[3]
        assert st.seg("c_pos")[:cb].tolist() == want[4]
        assert st.seg("c_len")[:cb].tolist() == want[5]
        assert st.seg("c_row")[:cb].tolist() == want[6]
    assert vg.num_replays == 2


def test_staging_alternates_host_buffers_so_the_one_in_flight_is_never_rewritten():
    """MTPGraphRunner._stage writes step N + 1 into the host buffer step N did not use: a chained step stages while
    step N's copy may still be queued behind N's forward (spec/chained_steps.py), and that copy must read N's rows.
    Each stage still lands on the device whole, and the third reuses the first's buffer."""
    st = MTPStatic.allocate(8, 4, K, 1, torch.float32, torch.device("cpu"))
    runner = MTPGraphRunner(api=None, model=None, caches=None, tables={}, tokens_per_entry={}, block_size=16,
                            pass_buckets=[8], chain_buckets=[4], k=K, static=st)
    names = PASS_FIELDS + PASS_EXTRA
    used, staged = [], []
    for step in range(3):
        rows = [[100 * step + 10 * i + j for j in range(3)] for i in range(len(names))]
        runner.stage_all(rows, [[0] for _ in CHAIN_FIELDS + CHAIN_EXTRA], 4, 1)
        used.append(st.host.data_ptr())
        staged.append(rows)
        assert [st.seg(n)[:3].tolist() for n in names] == rows  # the device holds this step's rows
        if step:  # the previous step's buffer (the one a queued copy would read) still holds its rows
            assert [st.host_spare[st.offsets[n]: st.offsets[n] + 3].tolist() for n in names] == staged[step - 1]
    assert used[0] != used[1] and used[2] == used[0]
