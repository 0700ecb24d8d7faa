"""tile_choice.py under the Triton interpreter: the check that lets a tile follow M, and the dispatch that obeys it.

The check compares a candidate tile with the fixed one bitwise and must be able to say no: under the interpreter
a deeper BLOCK_K rounds each K step's fp64 product to fp32 over more terms, so it changes the bits (a stand-in for
hardware where the tile enters the arithmetic), while other BLOCK_M / BLOCK_N at the same depth do not. Off a GPU
the mechanism stays off (every M takes the fixed tile). The H200 side: tests/nvidia/test_invariant_gpu.py.
"""

from nvidia_testutil import DEVICE  # noqa: I001  (sets TRITON_INTERPRET)

import pytest
import torch

from deepinfer.backend import MLASpec
from deepinfer.backends.nvidia.invariant import gemm, tile_choice
from deepinfer.backends.nvidia.invariant.gemm import Tile, bmm, plan_for
from deepinfer.backends.nvidia.invariant.mla import mla_attention, qblocks_host


@pytest.fixture(autouse=True)
def _fresh_checks():
    tile_choice.reset()
    yield
    tile_choice.reset()


def _rand(*shape, seed=0, dtype=torch.float16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def test_the_check_accepts_a_tile_that_keeps_the_bits_and_refuses_one_that_does_not():
    k, n = 72, 24  # the interpreter's plan: 16 x 16 x 16 tiles, 32-deep slices (32 + 32 + 8)
    w = _rand(1, k, n, seed=1, dtype=torch.float32, scale=0.2)  # fp32: products a K step's rounding can lose
    plan = plan_for(1, n, k, torch.float32)
    assert plan.tile.block_k == 16 and plan.slices(k) == 3
    assert tile_choice.same_bits_gemm(w, plan, Tile(32, 32, 16, 4, 1), rows=40)
    assert tile_choice.same_bits_gemm(w, plan, Tile(16, 32, 16, 4, 1), rows=40)
    assert not tile_choice.same_bits_gemm(w, plan, Tile(16, 16, 32, 4, 1), rows=40)


def test_bmm_takes_a_checked_large_tile_from_large_m_only(monkeypatch):
    monkeypatch.setattr(gemm, "LARGE_M", 32)
    k, n = 72, 24
    x, w = _rand(1, 40, k, seed=2, dtype=torch.bfloat16), _rand(1, k, n, seed=3, dtype=torch.bfloat16, scale=0.2)
    plan = plan_for(1, n, k, torch.bfloat16)
    f32 = torch.float32  # fp32 out: a bf16 output would round the K steps' differences away
    fixed = bmm(x, w, plan=plan, out_dtype=f32)
    # a tile registered as checked is taken from LARGE_M rows on; one that changes the bits shows which ran
    monkeypatch.setitem(gemm.CHECKED_LARGE_TILES, (1, n, k), Tile(16, 16, 32, 4, 1))
    assert torch.equal(bmm(x[:, :31], w, out_dtype=f32), fixed[:, :31])  # below LARGE_M: the plan's tile
    assert not torch.equal(bmm(x, w, out_dtype=f32), fixed)  # from LARGE_M: the registered tile
    assert torch.equal(bmm(x, w, plan=plan, out_dtype=f32), fixed)  # an explicit plan is never overridden


def test_off_the_gpu_the_mechanism_stays_off():
    w = _rand(1, 2048, 2048, dtype=torch.bfloat16)  # o_proj's shape, which has a large tile on the GPU
    assert not tile_choice.check_gemm(w)
    assert gemm.CHECKED_LARGE_TILES == {}
    calls = []
    assert not tile_choice.check_moe(("k",), lambda *a: calls.append(a), w.device)
    assert not tile_choice.check_mla(("k",), lambda *a: calls.append(a), w.device)
    assert calls == []  # nothing probed
    assert tile_choice.moe_choice(("k",), 1, 8) == (None, None)
    assert tile_choice.mla_tiles(("k",)) is None


def test_moe_and_mla_choices_after_a_passed_check():
    tile_choice._record(("moe", "k"), True, "test")
    assert tile_choice.moe_choice(("k",), 1, 8) == tile_choice.MOE_SMALL  # 8 pairs
    assert tile_choice.moe_choice(("k",), 9, 8) == (None, None)  # 72 pairs, a mid-size batch: the fixed tile
    assert tile_choice.moe_choice(("k",), tile_choice.MOE_LARGE_T, 8) == tile_choice.MOE_LARGE
    tile_choice._record(("mla", "k"), False, "test")  # a failed check keeps the fixed BLOCK_Q and warps
    assert tile_choice.mla_tiles(("k",)) is None
    tile_choice._record(("mla", "j"), True, "test")
    assert tile_choice.mla_tiles(("j",)) == (tile_choice.MLA_PREFILL, tile_choice.MLA_SPLIT_WARPS)


@pytest.mark.parametrize("rowsum_mma", [False, True])
def test_mla_two_tokens_per_program_give_one_token_per_program_bits(rowsum_mma):
    """The kernel path tile_choice enables for prefill and mixed steps (BLOCK_Q > 1; decode rows keep 1): a prefill of
    two requests (one with an odd length, so its last q-block holds one token) and a decode row beside them. With
    the row sums as MMAs (rowsum_mma) also 4 tokens and 8 warps a program; and the two row-sum methods agree to
    fp32 rounding (they sum the same weights, in another order)."""
    spec = MLASpec(num_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, kv_lora_rank=16,
                   softmax_scale=0.3)
    H, L, R, page, lens = 2, 16, 8, 8, (21, 34)
    per = 5
    cache = _rand(2 * per, page, L + R, seed=4, dtype=torch.float32)
    table = torch.arange(2 * per, dtype=torch.int32).view(2, per).to(DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32).to(DEVICE)
    q, qpe = _rand(sum(lens), H, L, seed=5, dtype=torch.float32), _rand(sum(lens), H, R, seed=6, dtype=torch.float32)
    tiles = [(1, 4), (2, 4)] + ([(4, 8)] if rowsum_mma else [])
    outs = [mla_attention(q, qpe, cache, table, seq, qblocks_host(list(lens), [0, 0], DEVICE, bq),
                          spec.softmax_scale, two_stage=False, block_q=bq, num_warps=w, rowsum_mma=rowsum_mma)
            for bq, w in tiles]
    for o in outs[1:]:
        assert torch.equal(outs[0], o)
    # the first request as one decode row at its last position, beside a chunk of the second (mixed step)
    qb = qblocks_host([1, 4], [20, 30], DEVICE, 2)
    rows = torch.tensor([20, 51, 52, 53, 54])
    mixed = mla_attention(q[rows].contiguous(), qpe[rows].contiguous(), cache, table, seq, qb, spec.softmax_scale,
                          two_stage=False, block_q=2, rowsum_mma=rowsum_mma)
    assert torch.equal(mixed, outs[0][rows])
    last = torch.tensor([20, 54])
    dec = mla_attention(q[last].contiguous(), qpe[last].contiguous(), cache, table, seq, None, spec.softmax_scale,
                        rowsum_mma=rowsum_mma)
    assert torch.equal(dec, outs[0][last])
    other = mla_attention(q, qpe, cache, table, seq, qblocks_host(list(lens), [0, 0], DEVICE, 1),
                          spec.softmax_scale, two_stage=False, rowsum_mma=not rowsum_mma)
    torch.testing.assert_close(other, outs[0], rtol=1e-5, atol=1e-6)
