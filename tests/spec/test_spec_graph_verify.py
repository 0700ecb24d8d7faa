"""Decode-shaped verification (spec/verify_batch.py) and the graph-timed step-cost profile (spec/cost_profile.py),
piece by piece on the CPU. End to end under graph replay (the nvidia backend, Triton interpreter):
tests/spec/test_spec_nvidia_interpreter.py."""

from __future__ import annotations

import time

import pytest
import torch

import deepinfer
from deepinfer.backend import ForwardBatch, GraphRunner
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.models.registry import load_model
from deepinfer.spec.cost_profile import profile_step_costs
from deepinfer.spec.verify_batch import decode_shaped, decode_shaped_if_graphed, graph_rows


def verify_batch() -> ForwardBatch:
    """Request 0: a verify row of 3 tokens (its real token + 2 drafts) over 5 cached; request 1: a decode over 2."""
    return ForwardBatch(
        input_ids=torch.tensor([7, 8, 9, 4]), positions=torch.tensor([5, 6, 7, 2]),
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([8, 3], dtype=torch.int32), context_lens=torch.tensor([5, 2], dtype=torch.int32),
        block_tables={"mla": torch.tensor([[3, 1], [2, -1]], dtype=torch.int32)},
        slot_mapping={"mla": torch.tensor([21, 22, 23, 10])}, logits_indices=torch.tensor([0, 1, 2, 3]),
        query_lens_cpu=[3, 1], seq_lens_cpu=[8, 3], context_lens_cpu=[5, 2], block_size=4)


def test_decode_shaped_is_one_causal_decode_row_per_token_in_the_same_order():
    b = verify_batch()
    f = decode_shaped(b)
    assert f.is_decode_only and f.num_seqs == 4
    # token j of request 0 sees positions <= 5 + j: seq_len 6, 7, 8; the decode keeps its own
    assert f.seq_lens.tolist() == [6, 7, 8, 3] and f.seq_lens_cpu == [6, 7, 8, 3]
    assert f.context_lens.tolist() == [5, 6, 7, 2] and f.context_lens_cpu == [5, 6, 7, 2]
    assert f.query_start_loc.tolist() == [0, 1, 2, 3, 4] and f.query_lens_cpu == [1, 1, 1, 1]
    assert f.block_tables["mla"].tolist() == [[3, 1], [3, 1], [3, 1], [2, -1]]
    for name in ("input_ids", "positions", "logits_indices"):  # same tokens, same rows: hidden states line up
        assert torch.equal(getattr(f, name), getattr(b, name))
    assert torch.equal(f.slot_mapping["mla"], b.slot_mapping["mla"])  # every row writes its own KV slot


def test_decode_shaped_refuses_state_rows_and_inconsistent_lengths():
    b = verify_batch()
    b.state_slots, b.state_slots_cpu = torch.tensor([0, 1], dtype=torch.int32), [0, 1]
    with pytest.raises(ValueError, match="per-sequence state"):
        decode_shaped(b)
    b = verify_batch()
    b.seq_lens_cpu = [9, 3]
    with pytest.raises(ValueError, match="request 0 has seq_len 9 != context_len 5 \\+ query_len 3"):
        decode_shaped(b)


class RowCapRunner(GraphRunner):
    """A graph runner that replays decode-only batches of at most max_rows rows; run() takes `seconds` and returns
    zero hidden states, recording what it was given."""

    def __init__(self, max_rows: int, hidden: int = 0, seconds: float = 0.0):
        self.max_rows, self.hidden, self.seconds = max_rows, hidden, seconds
        self.seen: list[ForwardBatch] = []

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode_only and batch.num_seqs <= self.max_rows

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.seen.append(batch)
        time.sleep(self.seconds)
        return torch.zeros(batch.num_seqs, self.hidden)


def test_flattened_only_when_the_graphs_cover_it():
    b = verify_batch()
    assert decode_shaped_if_graphed(b, None) == (b, False)
    assert decode_shaped_if_graphed(b, RowCapRunner(3)) == (b, False)  # 4 rows > the largest bucket: eager
    flat, ok = decode_shaped_if_graphed(b, RowCapRunner(4))
    assert ok and flat.is_decode_only and flat.num_seqs == 4
    dec = decode_shaped(b)
    assert decode_shaped_if_graphed(dec, RowCapRunner(4)) == (dec, False)  # decode-only already: not a verify step
    assert graph_rows(4, 3, 4096) == 16 and graph_rows(256, 5, 1024) == 1024 and graph_rows(1, 1, 1) == 1


def test_step_costs_are_graph_replays_where_the_graphs_cover_the_count():
    """Counts the graphs replay are timed as replays of decode rows shaped like verify rows (writing no KV);
    larger counts as eager forwards (the stub never sees them). The stub's replay takes 40 ms, so a table of
    graphed points only shows that the replay is what was timed (with an eager point after them, the table's
    suffix minimum may lower them to it: StepCostTable, where timing noise only slows)."""
    backend = CPUBackend()
    model = load_model(deepinfer.embedded_model_path(), backend, torch.float32, progress=False)
    stub = RowCapRunner(max_rows=4, hidden=model.config.hidden_size, seconds=0.04)
    table, graphed = profile_step_costs(model, backend, 16, 3, 4, repeats=2, graph_runner=stub, group_names=["mla"])
    assert table.tokens == [1, 2, 4] and graphed == ["graph"] * 3
    assert all(s >= 0.04 for s in table.seconds), table.seconds
    stub.seen.clear()
    table, graphed = profile_step_costs(model, backend, 16, 3, 8, repeats=2, graph_runner=stub, group_names=["mla"])
    # (a point on each side of the graphs' edge, 4 | 5: cost_profile.graph_edge)
    assert table.tokens == [1, 2, 4, 5, 8] and graphed == ["graph"] * 3 + ["varlen"] * 2
    assert [b.num_seqs for b in stub.seen] == [1, 1, 2, 2, 4, 4]  # two timed replays per graphed count
    probe = stub.seen[-1]
    assert probe.is_decode_only and probe.positions.tolist() == [0, 1, 2, 3]  # verify-shaped: 1 + k = 4 tokens
    assert probe.seq_lens.tolist() == [1, 2, 3, 4] and probe.slot_mapping["mla"].tolist() == [-1] * 4
    assert probe.input_ids.unique().numel() > 1  # different tokens reach different experts (cost_profile.py)



def test_step_costs_price_both_sides_of_the_graphs_edge():
    """Graphs up to 6 rows (not a power of two: a bucket at max_num_seqs x (1 + k)): the table times 6 as a replay
    and 7 eagerly, so a count at the edge is priced as the replay the engine runs there, not interpolated towards
    the next eager point (on an H100 the 64 | 128 points priced a 96-row graph step at ~11x its cost)."""
    backend = CPUBackend()
    model = load_model(deepinfer.embedded_model_path(), backend, torch.float32, progress=False)
    stub = RowCapRunner(max_rows=6, hidden=model.config.hidden_size, seconds=0.0)
    table, graphed = profile_step_costs(model, backend, 16, 3, 16, repeats=1, graph_runner=stub, group_names=["mla"])
    assert table.tokens == [1, 2, 4, 6, 7, 8, 16]
    assert graphed == ["graph"] * 4 + ["varlen"] * 3
    assert max(b.num_seqs for b in stub.seen) == 6
