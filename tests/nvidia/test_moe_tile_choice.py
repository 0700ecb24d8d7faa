"""The aligned MoE schedule's BLOCK_M and tile by size, scheme and dtype (fused_moe.pick_block_m,
fused_moe_config.gemm_config): what the H200 sweep of 2026-12-04 chose, and the cases it must not reach
(fp32 tiles of 128 rows overflow shared memory), and W8A8's prefill split of 128-row gate_up and 64-row down tiles
(the H100 sweep of 2026-12-05)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.nvidia import fused_moe_config as cfgs
from deepinfer.backends.nvidia.fused_moe import (
    BF16_BLOCK_M_128_MIN_PAIRS,
    W8A8_BLOCK_M_128_MIN_PAIRS,
    pick_block_m,
    w8a8_down_block_m,
)
from deepinfer.errors import BackendError

E = 64


@pytest.fixture
def compiled(monkeypatch):
    """The compiled-mode choices (the interpreter pins BLOCK_M 16 and tiny tiles)."""
    for name in ("TRITON_INTERPRET", "DEEPINFER_MOE_BLOCK_M", "DEEPINFER_MOE_TILE", "DEEPINFER_MOE_W8A8_SWAP_AB"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("pairs_per_expert, expect", [(8, 16), (16, 16), (40, 32), (64, 32), (65, 64),
                                                      (BF16_BLOCK_M_128_MIN_PAIRS, 64),
                                                      (BF16_BLOCK_M_128_MIN_PAIRS + 1, 128), (1536, 128)])
def test_bf16_block_m_by_pairs_per_expert(compiled, pairs_per_expert, expect):
    assert pick_block_m(pairs_per_expert * E, E, None, torch.bfloat16) == expect
    assert pick_block_m(pairs_per_expert * E, E, None, torch.float16) == expect


@pytest.mark.parametrize("scheme", ["fp8_block", "int4_awq", "fp4"])
def test_weight_only_quantized_and_fp32_experts_stay_at_64_rows(compiled, scheme):
    assert pick_block_m(1536 * E, E, scheme, torch.bfloat16) == 64
    assert pick_block_m(1536 * E, E, None, torch.float32) == 64


@pytest.mark.parametrize("pairs_per_expert, expect, down", [(65, 64, 64), (W8A8_BLOCK_M_128_MIN_PAIRS, 64, 64),
                                                            (W8A8_BLOCK_M_128_MIN_PAIRS + 1, 128, 64),
                                                            (1536, 128, 64)])
def test_w8a8_prefill_gate_up_at_128_rows_down_at_64(compiled, pairs_per_expert, expect, down):
    block_m = pick_block_m(pairs_per_expert * E, E, "fp8_w8a8", torch.bfloat16)
    assert (block_m, w8a8_down_block_m(block_m)) == (expect, down)
    # the env pins both GEMMs at its rows
    compiled.setenv("DEEPINFER_MOE_BLOCK_M", "128")
    assert w8a8_down_block_m(pick_block_m(pairs_per_expert * E, E, "fp8_w8a8")) == 128


def test_block_m_env_accepts_128_and_names_the_field(compiled):
    compiled.setenv("DEEPINFER_MOE_BLOCK_M", "128")
    assert pick_block_m(8 * E, E, "fp8_w8a8") == 128
    compiled.setenv("DEEPINFER_MOE_BLOCK_M", "96")
    with pytest.raises(BackendError, match="DEEPINFER_MOE_BLOCK_M"):
        pick_block_m(8 * E, E)


def test_prefill_tiles(compiled):
    # bf16 BLOCK_M 128: gate_up's dual program takes half the N of the single tile
    assert cfgs.gemm_config(128, dual=False) == {"block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 4}
    assert cfgs.gemm_config(128, dual=True) == {"block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4}
    # W8A8 BLOCK_M 64 (QGMMA, unswapped): down at 4 warps, gate_up at 8 with BN 128 per half
    down = cfgs.gemm_config(64, dual=False, scheme="fp8_w8a8")
    gate_up = cfgs.gemm_config(64, dual=True, scheme="fp8_w8a8")
    assert (down["num_warps"], down["num_stages"], down["block_n"], down["swap_ab"]) == (4, 3, 128, False)
    assert (gate_up["num_warps"], gate_up["num_stages"], gate_up["block_n"], gate_up["swap_ab"]) == (8, 3, 128, False)
    # W8A8 BLOCK_M 128 (the prefill gate_up): 8 warps, 4 stages
    assert cfgs.gemm_config(128, dual=True, scheme="fp8_w8a8") == {"block_n": 128, "block_k": 128, "num_warps": 8,
                                                                   "num_stages": 4, "swap_ab": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_block_m_128_matches_64_and_reference_at_real_shapes(compiled):
    """V2-Lite's experts (64 x [2 x 1408, 2048], top-6) at 6000 tokens (562 pairs an expert: BLOCK_M 128 by
    default) against the same call at BLOCK_M 64 and the fp32 reference."""
    from deepinfer.backend.native.moe import experts_forward
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    g = torch.Generator(device="cuda").manual_seed(0)
    t, d, inter, top = 6000, 2048, 1408, 6
    w13 = (torch.randn(E, 2 * inter, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
    w2 = (torch.randn(E, d, inter, device="cuda", generator=g) / inter ** 0.5).bfloat16()
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    ids = torch.rand(t, E, device="cuda", generator=g).topk(top, dim=1).indices
    wts = torch.rand(t, top, device="cuda", generator=g).softmax(dim=1)
    assert pick_block_m(t * top, E, None, x.dtype) == 128
    got = fused_moe(x, w13, w2, wts, ids)
    compiled.setenv("DEEPINFER_MOE_BLOCK_M", "64")
    at64 = fused_moe(x, w13, w2, wts, ids)
    ref = experts_forward(x.float(), w13.float(), w2.float(), wts, ids)
    rel = lambda a: float((a.float() - ref).norm() / ref.norm())
    assert rel(got) < 1e-2 and abs(rel(got) - rel(at64)) < 2e-3, (rel(got), rel(at64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_w8a8_block_m_128_matches_64_at_real_shapes(compiled):
    """V2-Lite's experts in fp8 W8A8 at 6000 tokens (562 pairs an expert: gate_up at 128 rows, down at 64 over
    the 128-row alignment) against the same call at BLOCK_M 64 for both GEMMs: the same products tile by tile."""
    from deepinfer.backend.native.quant_fp8 import quantize_weight_fp8_block
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    g = torch.Generator(device="cuda").manual_seed(0)
    t, d, inter, top = 6000, 2048, 1408, 6
    # per expert and projection, as the loader quantizes them (I 1408 = 11 blocks: the halves' scale rows follow)
    p13 = [quantize_weight_fp8_block(torch.randn(2 * inter, d, device="cuda", generator=g) / d ** 0.5)
           for _ in range(E)]
    p2 = [quantize_weight_fp8_block(torch.randn(d, inter, device="cuda", generator=g) / inter ** 0.5)
          for _ in range(E)]
    (w13, s13), (w2, s2) = ((torch.stack([q for q, _ in p]), torch.stack([sc for _, sc in p])) for p in (p13, p2))
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    ids = torch.rand(t, E, device="cuda", generator=g).topk(top, dim=1).indices
    wts = torch.rand(t, top, device="cuda", generator=g).softmax(dim=1)
    assert pick_block_m(t * top, E, "fp8_w8a8", x.dtype) == 128
    kw = {"scheme": "fp8_w8a8", "w13_scale": s13, "w2_scale": s2}
    got = fused_moe(x, w13, w2, wts, ids, direct=False, **kw)
    compiled.setenv("DEEPINFER_MOE_BLOCK_M", "64")
    at64 = fused_moe(x, w13, w2, wts, ids, direct=False, **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), at64.float(), atol=1e-2, rtol=1e-2)
