"""The nvidia Triton grouped MoE GEMMs with quantized experts (fp8 block / fp4 / int4 dequantized in the inner loop)
against densify-then-compute: under the interpreter at tiny shapes here, at real shapes on the GPU (gpu mark)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvidia"))
from nvidia_testutil import DEVICE, ON_GPU  # noqa: E402,I001  (sets TRITON_INTERPRET)
from moe_quant_util import make_experts, routing  # noqa: E402

from deepinfer.backend.native.moe import experts_forward  # noqa: E402


def int4_args(q) -> dict:
    """fused_moe's int4 arguments (zero points, group size) of a QuantizedExperts; none for fp8 / fp4."""
    if q.w13_zeros is None:
        return {}
    return {"w13_zeros": q.w13_zeros, "w2_zeros": q.w2_zeros, "group_size": q.group_size}


def assert_w8a8_matches(got: torch.Tensor, ref: torch.Tensor, ref_w8a16: torch.Tensor) -> None:
    """A W8A8 kernel's output against the oracle (each projection's input quantized per token per 128, fp32 product).
    Under the interpreter: the same quantized values, summation order only (1e-5). On a GPU the fp8 tensor cores
    accumulate a 128-deep K block in reduced precision before the kernel promotes it to fp32 (DeepSeek-V3's report
    puts Hopper's fp8 MMA accumulation at ~14 bits, why the scales' promotion is per 128), and a SiLU-and-mul value on a
    rounding boundary may land on the next e4m3 code (one e4m3 step is 6-12% of that value): session 31 on an H100
    measured 4e-4-4e-3 of absolute difference (norm-relative ~1e-3). So there: the norm-relative error within 1e-2
    and within a quarter of the distance from the oracle to the same experts run W8A16 (4-5.5% at these inputs),
    so a kernel that skipped the activation quantization still fails."""
    if not ON_GPU:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        return
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    gap = ((ref_w8a16.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < min(1e-2, gap / 4), f"W8A8 on the GPU: error {err:.2e} against the oracle; W8A16's distance {gap:.2e}"


def as_w8a16(q):
    """The same fp8 experts run W8A16 (fp8_block: activations not quantized): `assert_w8a8_matches`' far point."""
    from deepinfer.backend import QuantizedExperts

    return QuantizedExperts("fp8_block", q.w13, q.w13_scale, q.w2, q.w2_scale)


CASES = [("fp8_block", 48), ("fp4", 32), ("int4_awq", 32), ("int4_gptq", 64)]


@pytest.mark.parametrize("scheme,inter", CASES)
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("t,drop", [(1, False), (6, True)])
def test_fused_moe_quantized_matches_dense_twin(scheme, inter, direct, t, drop):
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    q, w13, w2 = make_experts(scheme, inter, device=DEVICE)
    x = torch.randn(t, w13.shape[2], generator=torch.Generator().manual_seed(3)).to(DEVICE)
    wts, ids = routing(t, drop=drop, device=DEVICE)
    got = fused_moe(x, q.w13, q.w2, wts, ids, direct=direct, skip_unrouted=drop, scheme=scheme,
                    w13_scale=q.w13_scale, w2_scale=q.w2_scale, **int4_args(q))
    ref = experts_forward(x, w13, w2, wts, ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("swap_ab", ["0", "1"])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("t,drop,dtype", [(1, False, torch.float32), (6, True, torch.float32),
                                          (5, False, torch.float16)])
def test_fused_moe_w8a8_matches_native_oracle(direct, t, drop, dtype, swap_ab, monkeypatch):
    """fp8_w8a8 experts: the direct GEMMs quantize x and the SiLU-and-mul output as they load them, the aligned
    ones take x quantized by fp8_act_quant and pass the gate_up output as e4m3 + scales (its epilogue): both
    against the native oracle (each projection's input quantized per token per 128, fp32 product). I = 200:
    two 128-channel groups, the second partial. fp32: the same quantized values, summation order only;
    fp16: the same rounding points, so an fp16 step here and there (SiLU's exp differs in its last bit).
    Not bf16: the interpreter truncates fp32 -> bf16 (0.1054 -> 0.1050, torch 0.1055; docs/quantization.md).
    swap_ab 1: every product runs as weight x activations^T (DEEPINFER_MOE_W8A8_SWAP_AB), same values."""
    from deepinfer.backend import NativeMoE, RouterSpec
    from deepinfer.backend.specs import MoESpec
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    monkeypatch.setenv("DEEPINFER_MOE_W8A8_SWAP_AB", swap_ab)
    q, _, _ = make_experts("fp8_w8a8", 200, device=DEVICE)
    x = torch.randn(t, q.w13.shape[2], generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    wts, ids = routing(t, drop=drop, device=DEVICE)
    got = fused_moe(x, q.w13, q.w2, wts, ids, direct=direct, skip_unrouted=drop, scheme="fp8_w8a8",
                    w13_scale=q.w13_scale, w2_scale=q.w2_scale)
    op = NativeMoE(MoESpec(router=RouterSpec(4, 2, "softmax", "greedy"), hidden_size=q.w13.shape[2],
                           intermediate_size=200))
    op.load_quantized_experts(q)
    ref = op.experts(x, wts, ids)
    assert got.dtype == dtype and not got.isnan().any()
    if dtype == torch.float32:
        assert_w8a8_matches(got, ref, experts_forward(x, None, None, wts, ids, quant=as_w8a16(q)))
    elif not ON_GPU:
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-4
    else:  # (fp16: the GPU's bound, `assert_w8a8_matches`)
        assert_w8a8_matches(got, ref, experts_forward(x, None, None, wts, ids, quant=as_w8a16(q)))


@pytest.mark.parametrize("scheme,inter", [("fp8_w8a8", 128), ("fp8_block", 48), ("int4_gptq", 64)])
@pytest.mark.parametrize("schedule", ["direct", "direct+combine", "aligned"])
def test_gemms_fold_stacked_quantized_shared_experts(scheme, inter, schedule):
    """fused_moe(stacked_shared=1): the last expert slot is a shared expert every token takes with weight 1.0,
    equal to the oracle's routed sum plus that expert run alone: the direct GEMMs (with and without the fused
    combine) and the aligned ones (its routing extended by with_shared_slots)."""
    from deepinfer.backend import QuantizedExperts
    from deepinfer.backends.nvidia.fused_moe import counters_for, fused_moe

    q, _, _ = make_experts(scheme, inter, device=DEVICE, num_experts=5)
    t, d = 3, 64
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    wts, ids = routing(t, device=DEVICE)
    got = fused_moe(x, q.w13, q.w2, wts, ids, direct=schedule != "aligned", stacked_shared=1, scheme=scheme,
                    w13_scale=q.w13_scale, w2_scale=q.w2_scale,
                    counters=counters_for(d, DEVICE) if schedule == "direct+combine" else None, **int4_args(q))
    fields = ("w13", "w13_scale", "w2", "w2_scale", "w13_zeros", "w2_zeros")
    routed = QuantizedExperts(scheme, *(None if getattr(q, f) is None else getattr(q, f)[:4] for f in fields),
                              q.group_size)
    shared_w, shared_ids = torch.ones(t, 1, device=DEVICE), torch.full((t, 1), 4, device=DEVICE)
    ref = experts_forward(x, None, None, wts, ids, quant=routed) + experts_forward(
        x, None, None, shared_w, shared_ids, quant=q)
    if scheme == "fp8_w8a8":
        far = experts_forward(x, None, None, wts, ids, quant=as_w8a16(routed)) + experts_forward(
            x, None, None, shared_w, shared_ids, quant=as_w8a16(q))
        assert_w8a8_matches(got, ref, far)
    else:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_w8a8_oracle_quantizes_the_activations():
    """The oracle's fp8_w8a8 differs from the same experts run W8A16 (fp8_block) by the activation rounding
    alone: a few per cent, never zero (so the W8A8 test above cannot pass on a W8A16 kernel)."""
    from deepinfer.backend import NativeMoE, QuantizedExperts, RouterSpec
    from deepinfer.backend.specs import MoESpec

    q, _, _ = make_experts("fp8_w8a8", 200)
    x = torch.randn(6, q.w13.shape[2], generator=torch.Generator().manual_seed(5))
    wts, ids = routing(6)
    outs = []
    for scheme in ("fp8_w8a8", "fp8_block"):
        op = NativeMoE(MoESpec(router=RouterSpec(4, 2, "softmax", "greedy"), hidden_size=q.w13.shape[2],
                               intermediate_size=200))
        op.load_quantized_experts(QuantizedExperts(scheme, q.w13, q.w13_scale, q.w2, q.w2_scale))
        outs.append(op.experts(x, wts, ids))
    rel = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    assert 1e-3 < rel < 0.1, rel


@pytest.mark.parametrize("swap_ab", [False, True])
def test_w8a8_scalar_weight_scale_promotion_is_bitwise_the_per_column_one(swap_ab):
    """The W8A8 K loop's promotion with one weight scale a tile (fused_moe_mainloop._fp8_b_scale, BS_SCALAR: BLOCK_N
    divides 128) against the per-column scales a 256-wide tile takes: the same fp32 factor a_s * b_s each element,
    so the same bits; so does the grouped program order. The down projection, N 320 (three 128-row scale blocks: 32-row tiles read scale rows 0-2),
    K 200 (two K blocks, the second partial), 8 pairs over 4 experts at BLOCK_M 16."""
    from deepinfer.backends.nvidia.fused_moe_gemm import aligned_gemm
    from deepinfer.backends.nvidia.moe_routing import moe_align
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8

    q, _, _ = make_experts("fp8_w8a8", 200, hidden=320, device=DEVICE)
    _, ids = routing(4, device=DEVICE)
    n = ids.numel()
    aq, a_s = quantize_act_fp8(torch.randn(n, 200, generator=torch.Generator().manual_seed(8)).to(DEVICE))
    sorted_ids, expert_ids, num_padded = moe_align(ids, 4, 16)
    outs = []
    for bn, group_m in ((32, 0), (256, 0), (32, 3)):
        out = torch.full((n, 320), float("nan"), device=DEVICE)
        aligned_gemm(aq, q.w2, out, sorted_ids, expert_ids, num_padded, n, 1, 16, scale=q.w2_scale,
                     scheme="fp8_w8a8", a_scale=a_s, act_dtype=torch.float32,
                     cfg={"block_n": bn, "block_k": 128, "num_warps": 4, "num_stages": 1, "swap_ab": swap_ab,
                          "group_m": group_m})
        outs.append(out)
    assert not outs[0].isnan().any() and outs[0].abs().max() > 0
    if ON_GPU and swap_ab:
        # swapped, BLOCK_N is the MMA's M: a 32- and a 256-row tile issue other tensor-core instructions, whose
        # reduced-precision fp8 accumulation (`assert_w8a8_matches`) sums in another order (session 31, H100:
        # ~1e-4 apart on values ~1). The scales' promotion is still checked: a wrong scale block is off by O(1).
        for other in outs[1:]:
            torch.testing.assert_close(other, outs[0], atol=2e-3, rtol=2e-3)
        return
    assert torch.equal(outs[0], outs[1])
    # the grouped program order (DEEPINFER_MOE_GROUP_M: 3 row tiles a group, the last group short) computes every
    # tile once, the same bits
    assert torch.equal(outs[0], outs[2])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="real shapes need the GPU")
@pytest.mark.parametrize("scheme", ["fp8_block", "fp8_w8a8", "fp4", "int4_awq"])
def test_fused_moe_quantized_real_shapes(scheme):
    """V3-like experts (D 7168, I 256 per rank share, 16 local experts) in bf16 against the dense twin (W8A8:
    against the native oracle, which quantizes the activations as the kernels do)."""
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    q, w13, w2 = make_experts(scheme, 256, device=DEVICE, num_experts=16, hidden=7168)
    for t in (1, 64, 300):
        x = torch.randn(t, 7168, device=DEVICE).bfloat16()
        wts, ids = routing(t, k=8, drop=True, device=DEVICE, num_experts=16)
        got = fused_moe(x, q.w13, q.w2, wts, ids, skip_unrouted=True, scheme=scheme, w13_scale=q.w13_scale,
                        w2_scale=q.w2_scale, **int4_args(q))
        if scheme == "fp8_w8a8":  # the oracle quantizes the activations too
            ref = experts_forward(x, None, None, wts, ids, quant=q)
        else:
            ref = experts_forward(x, w13.bfloat16(), w2.bfloat16(), wts, ids)
        assert (got.float() - ref.float()).norm() / ref.float().norm() < 2e-2


@pytest.mark.parametrize("scheme,inter", [("int4_awq", 32), ("int4_gptq", 64)])
@pytest.mark.parametrize("stacked", [0, 1])
def test_int4_gemv_mainloop_matches_dense_twin(scheme, inter, stacked, monkeypatch):
    """DEEPINFER_INT4_GEMV=1: one token's int4 direct GEMMs run the GEMV mainloop (fused_moe_gemv.py), routed
    experts and a stacked shared expert alike, against the dense twin (fp32: summation order only)."""
    from deepinfer.backends.nvidia.fused_moe import counters_for, fused_moe
    from deepinfer.backends.nvidia.fused_moe_config import direct_config
    from deepinfer.backends.nvidia.fused_moe_gemm import use_int4_gemv

    monkeypatch.setenv("DEEPINFER_INT4_GEMV", "1")
    assert use_int4_gemv(direct_config(True, scheme), 3, 1) and not use_int4_gemv(direct_config(True, scheme), 3, 2)
    q, w13, w2 = make_experts(scheme, inter, device=DEVICE, num_experts=4 + stacked)
    x = torch.randn(1, w13.shape[2], generator=torch.Generator().manual_seed(7)).to(DEVICE)
    wts, ids = routing(1, device=DEVICE)
    got = fused_moe(x, q.w13, q.w2, wts, ids, direct=True, scheme=scheme, w13_scale=q.w13_scale,
                    w2_scale=q.w2_scale, stacked_shared=stacked, counters=counters_for(x.shape[1], DEVICE),
                    **int4_args(q))
    ref = experts_forward(x, w13[:4], w2[:4], wts, ids)
    if stacked:
        ref = ref + experts_forward(x, w13, w2, torch.ones(1, 1, device=DEVICE), torch.full((1, 1), 4, device=DEVICE))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(Exception, match="GEMV mainloop is int4"):
        use_int4_gemv({"gemv": True}, 1, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="real shapes need the GPU")
def test_int4_gemv_mainloop_real_shapes(monkeypatch):
    """The int4 GEMV mainloop at V2-Lite's expert shapes (D 2048, I 1408, 64 experts, top-6) and one token, in bf16:
    against the dense twin in bf16 and against the MMA mainloop (the GEMV does not round the weight to bf16)."""
    from deepinfer.backends.nvidia.fused_moe import counters_for, fused_moe

    q, w13, w2 = make_experts("int4_awq", 1408, device=DEVICE, num_experts=64, hidden=2048)
    x = torch.randn(1, 2048, device=DEVICE).bfloat16()
    wts, ids = routing(1, k=6, device=DEVICE, num_experts=64)
    args = dict(direct=True, scheme="int4_awq", w13_scale=q.w13_scale, w2_scale=q.w2_scale,
                counters=counters_for(2048, DEVICE), **int4_args(q))
    monkeypatch.setenv("DEEPINFER_INT4_CUDA_GEMV", "0")  # the Triton mainloops (the CUDA GEMVs: test_int4_cuda_gemv)
    mma = fused_moe(x, q.w13, q.w2, wts, ids, **args)
    monkeypatch.setenv("DEEPINFER_INT4_GEMV", "1")
    gemv = fused_moe(x, q.w13, q.w2, wts, ids, **args)
    ref = experts_forward(x, w13.bfloat16(), w2.bfloat16(), wts, ids)
    for got in (gemv, mma):
        assert (got.float() - ref.float()).norm() / ref.float().norm() < 2e-2
    assert (gemv.float() - mma.float()).norm() / mma.float().norm() < 2e-2


@pytest.mark.parametrize("fold", ["0", "4", "5"])
def test_aligned_batches_fold_the_stacked_shared_experts_when_asked(fold, monkeypatch):
    """DEEPINFER_MOE_FOLD_SHARED_ALIGNED=5: an aligned batch (direct mode off) of 5 tokens beside fp8_w8a8 experts
    runs the shared experts stacked by fuse_shared_quantized in the grouped GEMMs and never calls the model's shared
    MLP; =0 and =4 (fewer tokens than the batch) call it (its add fused into the combine). Each against the oracle:
    routed experts plus the shared expert (fp32)."""
    from deepinfer.backend import QuantizedExperts, RouterSpec
    from deepinfer.backend.specs import MoESpec
    from deepinfer.backends.nvidia.backend import NvidiaBackend

    monkeypatch.setenv("DEEPINFER_MOE_FOLD_SHARED_ALIGNED", fold)
    monkeypatch.setenv("DEEPINFER_MOE_DIRECT_MAX_PAIRS", "0")
    q, _, _ = make_experts("fp8_w8a8", 128, device=DEVICE, num_experts=5)
    fields = ("w13", "w13_scale", "w2", "w2_scale")
    routed = QuantizedExperts("fp8_w8a8", *(getattr(q, f)[:4] for f in fields))
    shared = QuantizedExperts("fp8_w8a8", *(getattr(q, f)[4:] for f in fields))
    op = NvidiaBackend(device=DEVICE).make_moe(MoESpec(router=RouterSpec(4, 2, "softmax", "greedy"), hidden_size=64,
                                                       intermediate_size=128))
    op.load_quantized_experts(routed)
    assert op.fuse_shared_quantized(shared)
    calls = []

    def shared_mlp(x):  # the model's shared MLP: the stacked expert run alone through the oracle
        calls.append(x.shape[0])
        return experts_forward(x, None, None, torch.ones(x.shape[0], 1, device=DEVICE),
                               torch.full((x.shape[0], 1), 4, device=DEVICE), quant=q)

    t = 5
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    gate = torch.randn(4, 64, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    got = op.forward(x, x @ gate.t(), shared_experts=shared_mlp)
    assert calls == ([] if fold == "5" else [t])
    wts, ids = op.route_fn(x @ gate.t(), op.spec.router, None, None, None)
    ref = experts_forward(x, None, None, wts, ids, quant=routed) + shared_mlp(x)
    far = experts_forward(x, None, None, wts, ids, quant=as_w8a16(routed)) + experts_forward(
        x, None, None, torch.ones(t, 1, device=DEVICE), torch.full((t, 1), 4, device=DEVICE), quant=as_w8a16(q))
    assert_w8a8_matches(got, ref, far)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="real shapes need the GPU")
@pytest.mark.parametrize("scheme", ["fp8_w8a8", "int4_awq"])
def test_aligned_gemms_fold_stacked_shared_experts_real_shapes(scheme):
    """V2-Lite's expert shapes (D 2048, I 1408; 16 routed + 2 stacked shared, top-6) at 256 tokens in bf16, the shared
    experts in the aligned GEMMs: against the oracle's routed experts plus the two shared ones."""
    from deepinfer.backend import QuantizedExperts
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    q, _, _ = make_experts(scheme, 1408, device=DEVICE, num_experts=18, hidden=2048)
    x = torch.randn(256, 2048, device=DEVICE).bfloat16()
    wts, ids = routing(256, k=6, device=DEVICE, num_experts=16)
    got = fused_moe(x, q.w13, q.w2, wts, ids, direct=False, stacked_shared=2, scheme=scheme, w13_scale=q.w13_scale,
                    w2_scale=q.w2_scale, **int4_args(q))
    fields = ("w13", "w13_scale", "w2", "w2_scale", "w13_zeros", "w2_zeros")
    routed = QuantizedExperts(scheme, *(None if getattr(q, f) is None else getattr(q, f)[:16] for f in fields),
                              q.group_size)
    ones = torch.ones(256, 2, device=DEVICE)
    shared_ids = torch.tensor([[16, 17]], device=DEVICE).expand(256, 2)
    ref = experts_forward(x, None, None, wts, ids, quant=routed).float() + experts_forward(
        x, None, None, ones, shared_ids, quant=q).float()
    assert (got.float() - ref).norm() / ref.norm() < 2e-2
