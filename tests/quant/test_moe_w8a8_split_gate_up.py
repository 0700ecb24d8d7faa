"""The split W8A8 gate_up of the aligned MoE (fused_moe.split_gate_up, DEEPINFER_MOE_W8A8_SPLIT_GATE_UP_MIN_PAIRS):
one GEMM over both halves, then silu_mul_quant_fp8, then the down GEMM at half the rows per tile. Under the
interpreter at tiny shapes against the native oracle and the torch reference of the quant; at V2-Lite's expert
shapes on the GPU (gpu mark)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvidia"))
from nvidia_testutil import DEVICE, ON_GPU  # noqa: E402,I001  (sets TRITON_INTERPRET)
from moe_quant_util import make_experts, routing  # noqa: E402

from deepinfer.backend.native.moe import experts_forward  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_quant_equals_the_torch_reference(dtype):
    """silu_mul_quant_fp8 against torch: F.silu(gate) * up in the compute dtype (the native op's roundings), then
    quantized per token per 128 channels. I = 200: a partial second group. In fp32 the same bits as the separate
    quant kernel (fp8_act_quant.quantize_act_fp8, the dual epilogue's fp8_quant_rows) on torch's product, and
    the native quantization's values (it rounds e4m3 subnormals differently under the interpreter: one step);
    in fp16 SiLU's exp may differ in its last bit, so a value may land one e4m3 step away."""
    from deepinfer.backend.native.quant_fp8 import quantize_act_fp8 as native_quant
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8, silu_mul_quant_fp8

    x = (3 * torch.randn(7, 400, generator=torch.Generator().manual_seed(4))).to(DEVICE, dtype)
    q, s = silu_mul_quant_fp8(x)
    y = torch.nn.functional.silu(x[:, :200]) * x[:, 200:]
    assert q.shape == (7, 200) and s.shape == (7, 2) and q.dtype == torch.float8_e4m3fn
    tq, ts = quantize_act_fp8(y)
    rq, rs = native_quant(y)
    torch.testing.assert_close(s, rs, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=0)

    def deq(q, s):
        return q.float() * s.repeat_interleave(128, 1)[:, :200]

    if dtype == torch.float32:
        assert torch.equal(q.view(torch.uint8), tq.view(torch.uint8)) and torch.equal(s, ts)
        torch.testing.assert_close(deq(q, s), deq(rq, rs), atol=2e-3 * rs.max().item(), rtol=0)
    assert ((deq(q, s) - deq(rq, rs)).norm() / deq(rq, rs).norm()).item() < 2e-2


def test_silu_mul_quant_names_a_bad_input():
    from deepinfer.backends.nvidia.quant.fp8_act_quant import silu_mul_quant_fp8
    from deepinfer.errors import BackendError

    with pytest.raises(BackendError, match="2I"):
        silu_mul_quant_fp8(torch.zeros(3, 5, device=DEVICE))


@pytest.mark.parametrize("limit,pairs,inter,want", [
    ("0", 1000, 128, False),  # off (the default)
    ("2", 12, 128, True),  # 3 pairs an expert over 4 experts > 2
    ("3", 12, 128, False),  # 3 is not above 3
    ("2", 12, 200, False),  # I not whole 128-blocks: one GEMM could not read both halves' scales by row
])
def test_split_choice(limit, pairs, inter, want, monkeypatch):
    from deepinfer.backends.nvidia.fused_moe import split_gate_up

    monkeypatch.setenv("DEEPINFER_MOE_W8A8_SPLIT_GATE_UP_MIN_PAIRS", limit)
    assert split_gate_up(pairs, 4, "fp8_w8a8", inter) is want
    assert split_gate_up(pairs, 4, "fp8_block", inter) is False  # W8A16 has no e4m3 intermediate to split


@pytest.mark.parametrize("t,drop,stacked", [(6, False, 0), (9, True, 0), (5, False, 1)])
def test_split_gate_up_matches_the_oracle(t, drop, stacked, monkeypatch):
    """The aligned fp8_w8a8 experts with the split on (1 pair an expert is enough here): silu_mul_quant_fp8 runs
    (recorded), and the output equals the native oracle (each projection's input quantized per token per 128,
    fp32 product) as the fused dual path does: with pairs for other ranks (-1) and with a stacked shared expert.
    fp32, I = 256: two whole groups."""
    import deepinfer.backends.nvidia.quant.fp8_act_quant as aq
    from deepinfer.backend import QuantizedExperts
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    monkeypatch.setenv("DEEPINFER_MOE_W8A8_SPLIT_GATE_UP_MIN_PAIRS", "1")
    calls = []
    real = aq.silu_mul_quant_fp8
    monkeypatch.setattr(aq, "silu_mul_quant_fp8", lambda x: calls.append(tuple(x.shape)) or real(x))
    q, _, _ = make_experts("fp8_w8a8", 256, device=DEVICE, num_experts=4 + stacked)
    x = torch.randn(t, q.w13.shape[2], generator=torch.Generator().manual_seed(5)).to(DEVICE)
    wts, ids = routing(t, drop=drop, device=DEVICE)
    got = fused_moe(x, q.w13, q.w2, wts, ids, direct=False, skip_unrouted=drop, scheme="fp8_w8a8",
                    w13_scale=q.w13_scale, w2_scale=q.w2_scale, stacked_shared=stacked)
    assert calls == [(t * (2 + stacked), 512)]
    routed = QuantizedExperts("fp8_w8a8", q.w13[:4], q.w13_scale[:4], q.w2[:4], q.w2_scale[:4])
    ref = experts_forward(x, None, None, wts, ids, quant=routed)
    if stacked:
        ref = ref + experts_forward(x, None, None, torch.ones(t, 1, device=DEVICE),
                                    torch.full((t, 1), 4, device=DEVICE), quant=q)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("DEEPINFER_MOE_W8A8_SPLIT_GATE_UP_MIN_PAIRS", "0")
    fused = fused_moe(x, q.w13, q.w2, wts, ids, direct=False, skip_unrouted=drop, scheme="fp8_w8a8",
                      w13_scale=q.w13_scale, w2_scale=q.w2_scale, stacked_shared=stacked)
    assert len(calls) == 1  # the dual path quantizes in its epilogue
    torch.testing.assert_close(got, fused, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="real shapes need the GPU")
def test_split_gate_up_real_shapes(monkeypatch):
    """V2-Lite's routed experts (64 x [2 x 1408, 2048], top-6) at 4096 tokens in bf16, 384 pairs an expert: the
    split path against the oracle and against the fused dual path."""
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    q, _, _ = make_experts("fp8_w8a8", 1408, device=DEVICE, num_experts=64, hidden=2048)
    x = torch.randn(4096, 2048, device=DEVICE).bfloat16()
    wts, ids = routing(4096, k=6, device=DEVICE, num_experts=64)
    outs = {}
    for limit in ("0", "64"):
        monkeypatch.setenv("DEEPINFER_MOE_W8A8_SPLIT_GATE_UP_MIN_PAIRS", limit)
        outs[limit] = fused_moe(x, q.w13, q.w2, wts, ids, direct=False, scheme="fp8_w8a8", w13_scale=q.w13_scale,
                                w2_scale=q.w2_scale).float()
    ref = experts_forward(x, None, None, wts, ids, quant=q).float()
    assert (outs["64"] - ref).norm() / ref.norm() < 2e-2
    assert (outs["64"] - outs["0"]).norm() / outs["0"].norm() < 1e-2
