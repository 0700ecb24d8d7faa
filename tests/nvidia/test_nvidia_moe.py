"""Triton router, expert-sorted block layout and fused grouped-GEMM MoE vs the native ops."""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import DEVICE, backend, rel_err, tol  # noqa: I001  (sets TRITON_INTERPRET)

from deepinfer.backend import MoESpec, RouterSpec
from deepinfer.backend.native import NativeOps

ROUTERS = {
    "v2-lite softmax greedy": RouterSpec(16, 3, "softmax", "greedy", routed_scaling_factor=1.0),
    "v2 group-limited (20 per group)": RouterSpec(80, 4, "softmax", "group_limited_greedy", n_group=4, topk_group=2,
                                                  routed_scaling_factor=16.0),
    "v3 sigmoid noaux_tc": RouterSpec(32, 4, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                                      routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_route_matches_native(name):
    spec = ROUTERS[name]
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(11, spec.num_experts, generator=g).to(DEVICE)
    bias = torch.randn(spec.num_experts, generator=g).to(DEVICE) if spec.topk_method == "noaux_tc" else None
    w, ids = backend().route(logits, spec, bias)
    rw, rids = NativeOps().route(logits, spec, bias)
    assert ids.dtype == torch.int64 and torch.equal(ids, rids)
    assert rel_err(w, rw) < 1e-6


def test_moe_align_layout():
    from deepinfer.backends.nvidia.moe_routing import moe_align

    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 6, (13, 3), generator=g).to(DEVICE)
    block = 4
    sorted_ids, expert_ids, npad = moe_align(ids, 6, block)
    n = ids.numel()
    total = int(npad)
    assert total % block == 0 and sorted_ids.shape[0] == n + 6 * (block - 1)
    real = sorted_ids[:total]
    assert sorted(real[real < n].tolist()) == list(range(n))  # every pair exactly once
    assert bool((sorted_ids[total:] == n).all())
    flat = ids.reshape(-1)
    for blk in range(total // block):
        e = int(expert_ids[blk])
        members = sorted_ids[blk * block : (blk + 1) * block]
        members = members[members < n].long()
        assert members.numel() > 0 and bool((flat[members] == e).all())
    assert bool((expert_ids[total // block :] == -1).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["v2-lite softmax greedy", "v3 sigmoid noaux_tc"])
def test_fused_moe_layer_matches_native(dtype, name):
    router = ROUTERS[name]
    spec = MoESpec(router=router, hidden_size=32, intermediate_size=24)
    g = torch.Generator().manual_seed(10)
    e, d, i = router.num_experts, spec.hidden_size, spec.intermediate_size
    w13 = (torch.randn(e, 2 * i, d, generator=g) / d**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, d, i, generator=g) / i**0.5).to(DEVICE, dtype)
    x = torch.randn(9, d, generator=g).to(DEVICE, dtype)
    logits = torch.randn(9, e, generator=g).to(DEVICE)
    bias = torch.randn(e, generator=g).to(DEVICE) if router.topk_method == "noaux_tc" else None
    ours = backend().make_moe(spec)
    assert type(ours).__name__ == "TritonMoE"
    ours.load_experts(w13, w2)
    ref = NativeOps().make_moe(spec)
    ref.load_experts(w13, w2)
    out = ours.forward(x, logits, bias)
    exp = ref.forward(x, logits, bias)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, exp) < 5 * tol(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_weights_unweighted_slots_as_the_native_op(dtype):
    """The aligned schedule's combine: slots stored unweighted in the compute dtype, each weighted in fp32 as it is
    summed, give the bits of the fp32 weighted slots the native op sums (value rounded to the dtype, times the
    weight in fp32, summed in slot order), with and without the shared output; a weights tensor of the wrong shape
    is an error naming it."""
    from deepinfer.backends.nvidia.fused_moe import combine
    from deepinfer.errors import BackendError

    g = torch.Generator().manual_seed(11)
    t, k, d = 5, 6, 200
    slots = torch.randn(t, k, d, generator=g).to(DEVICE, dtype)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    shared = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    for sh in (None, shared):
        weighted = slots.float() * weights[:, :, None]
        want = combine(weighted.contiguous(), sh, dtype)
        got = combine(slots, sh, dtype, weights)
        assert torch.equal(got, want)
        if dtype == torch.float16 or DEVICE.type != "cpu":  # (the interpreter's fp32 -> bf16 cast rounds otherwise than
            # torch's, seen here: 1 ulp toward zero)
            acc = weighted[:, 0].clone()
            for j in range(1, k):  # in slot order, as both kernels sum
                acc += weighted[:, j]
            ref = (acc.to(dtype).float() + sh.float()).to(dtype) if sh is not None else acc.to(dtype)
            assert torch.equal(want, ref)
    with pytest.raises(BackendError, match="weights"):
        combine(slots, None, dtype, weights[:, :3].contiguous())


def test_unsupported_router_uses_native_and_says_so():
    be = backend()
    spec = MoESpec(router=RouterSpec(8, 2, "sqrtsoftplus", "noaux_tc"), hidden_size=16, intermediate_size=16)
    assert type(be.make_moe(spec)).__name__ == "NativeMoE"
    assert "native for" in be.op_coverage()["moe"]
