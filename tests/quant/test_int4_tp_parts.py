"""Tensor-parallel parts of int4 (AWQ / GPTQ) and int8 (W8A8) records: a rank's part, cut from the packed words,
zero points and scales, dequantizes to the same slice of the whole weight (the reference: the records' own
dequantization, `dequant_int4`, of the whole record, then sliced); a row part of a GPTQ act-order record keeps every
group's zero points and scales; cuts that would split a packed word or a quantization group are refused naming the
layer. The model-level check (a TP=2 model on an int4 checkpoint gives one process's logits; an act-order
checkpoint's routed experts named) is in tests/parallel/test_tensor_parallel_model.py.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend import Int4Weight, dequant_int4
from deepinfer.checkpoints.awq_writer import pack_awq_cols, pack_gptq, quantize_int4
from deepinfer.errors import ModelLoadError
from deepinfer.models.loader import Int8Weight

N, K = 64, 256  # [out, in]


def _record(method: str, group: int, act_order: bool = False, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    perm = torch.randperm(K, generator=g) if act_order else torch.arange(K)
    inv = torch.argsort(perm)
    q, z, s = quantize_int4(w[:, perm], group)
    q = q[inv]
    if method == "awq":
        return Int4Weight("awq", pack_awq_cols(q), pack_awq_cols(z), s, group_size=group)
    qweight, qzeros = pack_gptq(q, z)
    return Int4Weight("gptq", qweight, qzeros, s, g_idx=(inv // group).to(torch.int32), group_size=group,
                      zero_offset=1)


CASES = [("awq", 32, False), ("awq", 128, False), ("gptq", 32, False), ("gptq", 64, True)]


@pytest.mark.parametrize("method,group,act_order", CASES)
@pytest.mark.parametrize("tp", [2, 4])
def test_column_parts_dequantize_to_the_slices_of_the_whole(method, group, act_order, tp):
    rec = _record(method, group, act_order)
    assert rec.act_order == act_order
    whole = dequant_int4(rec)  # [N, K]
    size = N // tp
    parts = []
    for r in range(tp):
        part = rec.part(0, r * size, (r + 1) * size, "x.q_b_proj")
        part.check("x.q_b_proj", size, K)
        parts.append(dequant_int4(part))
        torch.testing.assert_close(parts[-1], whole[r * size:(r + 1) * size], atol=0, rtol=0)
    assert torch.equal(torch.cat(parts, 0), whole)


@pytest.mark.parametrize("method,group", [("awq", 32), ("awq", 128), ("gptq", 32), ("gptq", 64)])
@pytest.mark.parametrize("tp", [2])
def test_row_parts_dequantize_to_the_slices_of_the_whole(method, group, tp):
    rec = _record(method, group)
    whole = dequant_int4(rec)
    size = K // tp
    for r in range(tp):
        part = rec.part(1, r * size, (r + 1) * size, "x.o_proj")
        part.check("x.o_proj", N, size)  # the layer's own shape check passes on the part
        assert not part.act_order
        torch.testing.assert_close(dequant_int4(part), whole[:, r * size:(r + 1) * size], atol=0, rtol=0)


def test_cuts_that_split_a_word_or_a_group_are_refused_naming_the_layer():
    awq = _record("awq", 128)
    with pytest.raises(ModelLoadError, match=r"layers\.0\.mlp\.gate_proj.*packed int32 word of 8"):
        awq.part(0, 0, 12, "layers.0.mlp.gate_proj")
    with pytest.raises(ModelLoadError, match=r"layers\.0\.mlp\.down_proj.*quantization group of 128"):
        awq.part(1, 0, 64, "layers.0.mlp.down_proj")  # K 256 over 4 ranks: 64 per rank, half a group
    act = _record("gptq", 64, act_order=True)
    with pytest.raises(ModelLoadError, match=r"o_proj.*quantization group of 64"):
        act.part(1, 0, 96, "o_proj")  # act-order parts are whole groups' worth of rows too


@pytest.mark.parametrize("tp", [2, 4])
def test_act_order_row_parts_keep_every_group_and_dequantize_to_the_slices(tp):
    """A GPTQ act-order (desc_act) record's row part: its rows' g_idx as stored (groups from across the whole K),
    every group's zero points and scales (num_groups), the layer's shape check passing on it, and its dequantization
    the whole's columns bit for bit; a column cut of that part too."""
    rec = _record("gptq", 64, act_order=True)
    whole = dequant_int4(rec)
    size = K // tp
    for r in range(tp):
        part = rec.part(1, r * size, (r + 1) * size, "x.o_proj")
        part.check("x.o_proj", N, size)
        assert part.num_groups == K // 64 and part.scales.shape == (K // 64, N)
        assert torch.equal(part.g_idx, rec.g_idx[r * size:(r + 1) * size])
        assert part.g_idx.max() >= size // 64 or r > 0  # rank 0's rows reach groups past its own count
        torch.testing.assert_close(dequant_int4(part), whole[:, r * size:(r + 1) * size], atol=0, rtol=0)
        col = part.part(0, 8, 40, "x.o_proj")  # and a column cut of the part keeps every group as well
        col.check("x.o_proj", 32, size)
        torch.testing.assert_close(dequant_int4(col), whole[8:40, r * size:(r + 1) * size], atol=0, rtol=0)


def test_an_act_order_row_part_in_group_order_is_a_plain_part():
    """Rows that happen to be groups 0.. in order (an act-order record whose first half is unpermuted) make a plain
    part of those groups: no num_groups, no act-order, so no consumer meets the whole's scales with such a g_idx."""
    rec = _record("gptq", 64, act_order=True)
    g_idx = rec.g_idx.clone()
    g_idx[:K // 2] = torch.arange(K // 2, dtype=torch.int32) // 64  # the first half's rows in order; the rest as is
    g_idx[K // 2:] = torch.sort(rec.g_idx[rec.g_idx >= (K // 2) // 64]).values.flip(0)
    mixed = Int4Weight("gptq", rec.qweight, rec.qzeros, rec.scales, g_idx, 64, 1)
    assert mixed.act_order
    whole = dequant_int4(mixed)
    first, second = mixed.part(1, 0, K // 2, "x"), mixed.part(1, K // 2, K, "x")
    assert first.num_groups is None and not first.act_order and first.scales.shape == (K // 2 // 64, N)
    assert second.num_groups == K // 64 and second.act_order
    torch.testing.assert_close(dequant_int4(first), whole[:, :K // 2], atol=0, rtol=0)
    torch.testing.assert_close(dequant_int4(second), whole[:, K // 2:], atol=0, rtol=0)


def test_num_groups_is_for_act_order_row_parts_only():
    """num_groups on an AWQ record, or below the part's own groups, is a load error naming the layer."""
    awq = _record("awq", 32)
    bad = Int4Weight("awq", awq.qweight, awq.qzeros, awq.scales, group_size=32, num_groups=K // 32)
    with pytest.raises(ModelLoadError, match=r"^x\.o_proj: num_groups 8 is for a GPTQ act-order row part"):
        bad.check("x.o_proj", N, K)
    act = _record("gptq", 64, act_order=True)
    few = Int4Weight("gptq", act.qweight, act.qzeros, act.scales, act.g_idx, 64, 1, num_groups=2)
    with pytest.raises(ModelLoadError, match=r"num_groups 2 is for a GPTQ act-order row part"):
        few.check("x.o_proj", N, K)


def test_int8_parts_keep_their_channel_scales():
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    rec = Int8Weight(w, torch.rand(N, 1) + 0.5, torch.zeros(N, 1))
    col = rec.part(0, 16, 48, "x")
    col.check("x", 32, K)
    assert torch.equal(col.weight, w[16:48]) and torch.equal(col.weight_scale, rec.weight_scale[16:48])
    row = rec.part(1, 128, 256, "x")
    row.check("x", N, 128)
    assert torch.equal(row.weight, w[:, 128:]) and torch.equal(row.weight_scale, rec.weight_scale)
    with pytest.raises(ModelLoadError, match=r"^x: cannot take \[0:300\]"):
        rec.part(1, 0, 300, "x")


def test_reordered_records_dequantize_to_the_permuted_whole():
    """The routed experts' act-order cut under TP (models/layers/experts.py `_cut_act_order`): a GPTQ record's inputs
    sorted by group give a plain record (contiguous groups) whose weight is the whole's columns in that order, and its
    outputs reordered give the whole's rows in that order; AWQ records (no act-order) are refused."""
    from deepinfer.backend import act_order_permutation

    rec = _record("gptq", 32, act_order=True, seed=3)
    whole = dequant_int4(rec)
    perm = act_order_permutation(rec.g_idx, 32, "down")
    sorted_rec = rec.reorder_inputs(perm, "down")
    assert rec.act_order and not sorted_rec.act_order
    assert torch.equal(dequant_int4(sorted_rec), whole[:, perm])
    part = sorted_rec.part(1, 64, 128, "down")  # whole groups of the sorted inputs: a plain part
    assert part.num_groups is None and torch.equal(dequant_int4(part), whole[:, perm[64:128]])
    rows = torch.randperm(N, generator=torch.Generator().manual_seed(4))
    assert torch.equal(dequant_int4(rec.reorder_outputs(rows, "gate")), whole[rows])
    with pytest.raises(ModelLoadError, match="gate: only a GPTQ record"):
        _record("awq", 32).reorder_outputs(rows, "gate")
    with pytest.raises(ModelLoadError, match="up: only a whole GPTQ record"):
        rec.part(1, 0, 128, "x").reorder_inputs(perm[:128], "up")
