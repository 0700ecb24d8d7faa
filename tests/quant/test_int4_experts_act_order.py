"""GPTQ act-order (desc_act) routed experts kept int4 (models/layers/quant/int4_experts.py): the down projection's
input channels sorted by group at load with the gate / up rows in the same order, the gate / up groups kept per
input channel (QuantizedExperts.w13_g_idx); the native / cpu ops against the dense twin dequantized from the
writer's values, and what the loader refuses."""

from __future__ import annotations

import pytest
import torch
from moe_quant_util import D, E, _int4_projection, make_int4_experts, routing

from deepinfer.backend import BackendError, MoESpec, NativeMoE, RouterSpec
from deepinfer.backend.native.moe import experts_forward
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.errors import ModelLoadError
from deepinfer.models.layers.quant.int4_experts import stack_int4_experts

ROUTER = RouterSpec(num_experts=E, top_k=2, scoring_func="softmax", topk_method="greedy")
INTER = 64


@pytest.mark.parametrize("make", ["native", "cpu"])
def test_act_order_experts_match_the_dense_twin(make):
    q, w13, w2 = make_int4_experts("int4_gptq", INTER, act_order=True)
    assert q.w13_g_idx is not None and tuple(q.w13_g_idx.shape) == (E, D) and q.w13_g_idx.dtype == torch.int32
    assert not torch.equal(q.w13_g_idx[1].long(), torch.arange(D) // 32)  # (a real act-order order)
    spec = MoESpec(router=ROUTER, hidden_size=D, intermediate_size=INTER)
    op = NativeMoE(spec) if make == "native" else CPUBackend().make_moe(spec)
    op.load_quantized_experts(q)
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(5))
    for t, drop in ((7, False), (5, True), (1, False)):
        wts, ids = routing(t, drop=drop)
        ref = experts_forward(x[:t], w13, w2, wts, ids)
        torch.testing.assert_close(op.experts(x[:t], wts, ids), ref, atol=1e-5, rtol=1e-5)


def test_the_down_projections_order_is_resolved_at_load():
    """Expert 1's down projection is act-order: its stored input channels come out sorted by group, and the gate /
    up rows in the same order, so the dequantized expert equals the twin with the intermediate channels permuted
    (the same function); expert 0's (in order) is left as it was."""
    from deepinfer.backend.native.moe import dequant_expert

    q, w13, w2 = make_int4_experts("int4_gptq", INTER, act_order=True)
    for e in range(2):
        d13, d2 = dequant_expert(q, e, torch.float32)
        gate, up = d13[:INTER], d13[INTER:]
        # the same permutation on both sides of the intermediate dimension: match it up from the gate rows
        perm = torch.tensor([int(torch.argmin((w13[e, :INTER] - row).abs().sum(1))) for row in gate])
        assert sorted(perm.tolist()) == list(range(INTER))
        torch.testing.assert_close(gate, w13[e, :INTER][perm])
        torch.testing.assert_close(up, w13[e, INTER:][perm])
        torch.testing.assert_close(d2, w2[e][:, perm])
        assert (perm.tolist() == list(range(INTER))) == (e == 0)


def _records(seed: int, perm_gate, perm_up, perm_down):
    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(INTER, D, generator=g), torch.randn(INTER, D, generator=g), torch.randn(D, INTER, generator=g)]
    return [_int4_projection(m, "gptq", 32, p)[0] for m, p in zip(mats, (perm_gate, perm_up, perm_down))]


def test_the_loader_refuses_what_it_cannot_keep_int4():
    p1, p2 = torch.randperm(D, generator=torch.Generator().manual_seed(1)), torch.randperm(
        D, generator=torch.Generator().manual_seed(2))
    gate, up, down = _records(0, p1, p2, None)
    with pytest.raises(ModelLoadError, match=r"L\.experts\.0: the gate_proj and up_proj g_idx differ"):
        stack_int4_experts("int4_gptq", "L", [(0, gate, up, down)])
    gate, up, down = _records(0, p1, None, None)
    with pytest.raises(ModelLoadError, match="gate_proj and up_proj g_idx differ"):
        stack_int4_experts("int4_gptq", "L", [(0, gate, up, down)])
    gate, up, down = _records(0, p1, p1, torch.randperm(INTER, generator=torch.Generator().manual_seed(3)))
    down.g_idx = down.g_idx.clone()
    down.g_idx[0] = (down.g_idx[0] + 1) % (INTER // 32)  # one group one channel short, another one long
    with pytest.raises(ModelLoadError, match=r"L\.experts\.0\.down_proj\.g_idx: each group must hold exactly 32"):
        stack_int4_experts("int4_gptq", "L", [(0, gate, up, down)])


def test_check_names_a_bad_g_idx():
    q, _, _ = make_int4_experts("int4_gptq", INTER, act_order=True)
    for bad, match in ((q.w13_g_idx.long(), "w13_g_idx: torch.int64"), (q.w13_g_idx[:, :32].contiguous(), r"\(4, 32\)"),
                       (q.w13_g_idx + 5, "holds groups outside")):
        broken = type(q)(q.scheme, q.w13, q.w13_scale, q.w2, q.w2_scale, q.w13_zeros, q.w2_zeros, q.group_size, bad)
        with pytest.raises(BackendError, match=match):
            broken.check(E, D, INTER)
    awq = type(q)("int4_awq", q.w13, q.w13_scale, q.w2, q.w2_scale, q.w13_zeros, q.w2_zeros, q.group_size, q.w13_g_idx)
    with pytest.raises(BackendError, match=r"\(int4_awq\) w13_g_idx is GPTQ act-order's"):
        awq.check(E, D, INTER)


# ---------------------------------------------------------------- the nvidia Triton GEMMs (interpreter here)


@pytest.mark.parametrize("layout", ["g_idx", "sorted"])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("t,drop", [(1, False), (6, True)])
def test_nvidia_grouped_gemms_take_act_order_experts(direct, t, drop, layout):
    """fused_moe against the dense twin, the act-order gate / up weights either as stored with w13_g_idx
    (quant/tiles.py int4_tile gathering zero points and scales per input channel) or with their columns sorted by
    group and x gathered through w13_perm (quant/act_order.py, the nvidia op's layout): the direct and aligned
    schedules, one token and a ragged batch with -1 ids. Without the g_idx / perm the same weights give another
    result (the check can fail)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvidia"))
    from nvidia_testutil import DEVICE  # (sets TRITON_INTERPRET on the CPU)

    from deepinfer.backends.nvidia.fused_moe import fused_moe

    q, w13, w2 = make_int4_experts("int4_gptq", INTER, device=DEVICE, act_order=True)
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    wts, ids = routing(t, drop=drop, device=DEVICE)
    args = {"direct": direct, "skip_unrouted": drop, "scheme": "int4_gptq", "w13_scale": q.w13_scale,
            "w2_scale": q.w2_scale, "w13_zeros": q.w13_zeros, "w2_zeros": q.w2_zeros, "group_size": q.group_size}
    if layout == "sorted":
        from deepinfer.backends.nvidia.quant.act_order import sort_act_order_columns

        q, perm = sort_act_order_columns(q)
        assert q.w13_g_idx is None and perm.dtype == torch.int32 and tuple(perm.shape) == (E, D)
        order = {"w13_perm": perm}
    else:
        order = {"w13_g_idx": q.w13_g_idx}
    got = fused_moe(x, q.w13, q.w2, wts, ids, **order, **args)
    ref = experts_forward(x, w13, w2, wts, ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fused_moe(x, q.w13, q.w2, wts, ids, **args), ref, atol=1e-3)


def test_nvidia_op_keeps_act_order_experts_apart_from_the_shared_ones(monkeypatch):
    """The nvidia MoE op sorts act-order gate / up columns by group at load and hands the order to its GEMMs
    (w13_perm; DEEPINFER_INT4_ACT_ORDER_SORT=0: w13_g_idx, the weights as stored), and does not stack quantized shared
    experts beside act-order routed ones (the model's shared MLP runs)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvidia"))
    from nvidia_testutil import DEVICE  # noqa: F401

    from deepinfer.backends.nvidia.moe import TritonMoE

    q, _, _ = make_int4_experts("int4_gptq", INTER, act_order=True)
    shared, _, _ = make_int4_experts("int4_gptq", INTER, num_experts=1, seed=4)
    from deepinfer.backend import route

    op = TritonMoE(MoESpec(router=ROUTER, hidden_size=D, intermediate_size=INTER), route_fn=route)
    op.load_quantized_experts(q)
    got = op._gemm_weights()
    assert got["w13_g_idx"] is None and torch.equal(got["w13_perm"].long(), torch.argsort(q.w13_g_idx.long(), dim=1,
                                                                                         stable=True))
    assert not torch.equal(got["w13"], q.w13) and torch.equal(got["w2"], q.w2)  # (only gate / up re-laid)
    assert op.fuse_shared_quantized(shared) is False and op.quant_shared is None
    monkeypatch.setenv("DEEPINFER_INT4_ACT_ORDER_SORT", "0")
    op.load_quantized_experts(q)
    assert op._gemm_weights()["w13_g_idx"] is q.w13_g_idx and op._gemm_weights()["w13_perm"] is None


def test_an_op_that_does_not_list_act_order_gets_the_experts_densified():
    """INT4_ACT_ORDER is what an op lists beside "int4_gptq" where it reads w13_g_idx: an op listing the scheme alone
    (a plugin written before the field) is refused such experts at load_quantized_experts, and the model's experts
    keep them quantized only for an op listing both (else densified, which every op runs)."""
    from types import SimpleNamespace

    from deepinfer.backend import INT4_ACT_ORDER, MOE_QUANT_SCHEMES
    from deepinfer.models.layers.experts import ExpertWeights

    class SchemeOnly(NativeMoE):
        def quantized_expert_schemes(self):
            return MOE_QUANT_SCHEMES

    q, _, _ = make_int4_experts("int4_gptq", INTER, act_order=True)
    spec = MoESpec(router=ROUTER, hidden_size=D, intermediate_size=INTER)
    with pytest.raises(BackendError, match="does not run GPTQ act-order routed experts"):
        SchemeOnly(spec).load_quantized_experts(q)
    assert INT4_ACT_ORDER in NativeMoE(spec).quantized_expert_schemes()
    assert INT4_ACT_ORDER in CPUBackend().make_moe(spec).quantized_expert_schemes()
    # the model side: experts holding act-order records
    p_in = torch.randperm(D, generator=torch.Generator().manual_seed(9))
    gate, up, down = _records(0, p_in, p_in, None)
    experts = SimpleNamespace(scheme="int4_gptq", names=("gate", "up", "down"),
                              _loaded={(0, "gate", "weight"): gate, (0, "up", "weight"): up, (0, "down", "weight"): down})
    keeps = ExpertWeights.keeps_quantized
    assert keeps(experts, (*MOE_QUANT_SCHEMES, INT4_ACT_ORDER)) is True
    assert keeps(experts, MOE_QUANT_SCHEMES) is False
    # a down projection's act-order alone is resolved at load (no w13_g_idx): any op listing the scheme takes it
    g2, u2, d2 = _records(1, None, None, torch.randperm(INTER, generator=torch.Generator().manual_seed(4)))
    down_only = SimpleNamespace(scheme="int4_gptq", names=("gate", "up", "down"),
                                _loaded={(0, "gate", "weight"): g2, (0, "up", "weight"): u2, (0, "down", "weight"): d2})
    assert d2.act_order and not g2.act_order and keeps(down_only, MOE_QUANT_SCHEMES) is True
    assert stack_int4_experts("int4_gptq", "L", [(0, g2, u2, d2)]).w13_g_idx is None


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["g_idx", "sorted"])
def test_act_order_experts_real_shapes_on_the_gpu(layout):
    """V2-Lite's expert shapes (D 2048, I 1408, group 128, 16 experts, top-6) in GPTQ act-order, bf16, on the GPU,
    as stored (w13_g_idx) and with the gate / up columns sorted by group (w13_perm, the nvidia op's layout): at 1
    token the direct schedule (sorted: the CUDA GEMVs, staging x in the sorted order, and the Triton direct GEMMs
    with DEEPINFER_INT4_CUDA_GEMV=0), aligned at 64 and 300, against the dense twin in bf16."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvidia"))
    from nvidia_testutil import DEVICE, ON_GPU

    if not ON_GPU:
        pytest.skip("real shapes need the GPU")
    from deepinfer.backends.nvidia.fused_moe import fused_moe
    from deepinfer.backends.nvidia.quant import int4_cuda
    from deepinfer.backends.nvidia.quant.act_order import sort_act_order_columns

    q, w13, w2 = make_int4_experts("int4_gptq", 1408, device=DEVICE, num_experts=16, hidden=2048, group=128,
                                   act_order=True)
    order = {"w13_g_idx": q.w13_g_idx}
    if layout == "sorted":
        q, perm = sort_act_order_columns(q)
        order = {"w13_perm": perm}
    for t in (1, 64, 300):
        x = torch.randn(t, 2048, device=DEVICE).bfloat16()
        wts, ids = routing(t, k=6, drop=t > 1, device=DEVICE, num_experts=16)
        args = {"skip_unrouted": t > 1, "scheme": "int4_gptq", "w13_scale": q.w13_scale, "w2_scale": q.w2_scale,
                "w13_zeros": q.w13_zeros, "w2_zeros": q.w2_zeros, "group_size": 128, **order}
        got = fused_moe(x, q.w13, q.w2, wts, ids, **args)
        ref = experts_forward(x, w13.bfloat16(), w2.bfloat16(), wts, ids)
        assert (got.float() - ref.float()).norm() / ref.float().norm() < 2e-2
        if t == 1 and layout == "sorted":  # the CUDA GEMVs took it (x staged in the sorted order), and Triton agrees
            cuda = int4_cuda.moe(x, q.w13, q.w2, q.w13_scale, q.w2_scale, q.w13_zeros, q.w2_zeros, ids,
                                 wts.float(), 0, order["w13_perm"])
            assert torch.equal(got, cuda)
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("DEEPINFER_INT4_CUDA_GEMV", "0")
                tri = fused_moe(x, q.w13, q.w2, wts, ids, **args)
            assert (tri.float() - got.float()).norm() / got.float().norm() < 1e-2
