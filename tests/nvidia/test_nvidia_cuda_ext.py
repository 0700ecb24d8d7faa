"""CUDA C++ kernels (csrc/cuda) against the Triton and native twins, at DeepSeek's real router shapes. GPU only."""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import ON_GPU  # noqa: I001

from deepinfer.backend import RouterSpec
from deepinfer.backend.native import NativeOps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU and nvcc")]

ROUTERS = [
    RouterSpec(64, 6, "softmax", "greedy", routed_scaling_factor=1.0),  # V2-Lite
    RouterSpec(160, 6, "softmax", "group_limited_greedy", n_group=8, topk_group=3, routed_scaling_factor=16.0),  # V2
    RouterSpec(256, 8, "sigmoid", "noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
               routed_scaling_factor=2.5),  # V3
]


@pytest.fixture(scope="module")
def ext():
    from deepinfer.backends.nvidia import cuda_ext

    return cuda_ext.load()


@pytest.mark.parametrize("spec", ROUTERS, ids=["v2-lite", "v2", "v3"])
def test_cuda_grouped_topk_matches_native(ext, spec):
    from deepinfer.backends.nvidia import cuda_ext

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(1000, spec.num_experts, device="cuda", generator=g)
    bias = torch.randn(spec.num_experts, device="cuda", generator=g) * 0.1 if spec.topk_method == "noaux_tc" else None
    w, ids = cuda_ext.grouped_topk(ext, logits, spec, bias)
    rw, rids = NativeOps().route(logits, spec, bias)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_cuda_moe_align_layout(ext, tokens):
    from deepinfer.backends.nvidia.moe_routing import moe_align

    ids = torch.randint(0, 64, (tokens, 6), device="cuda")
    s, e, n = ext.moe_align(ids, 64, 16)
    ts, te, tn = moe_align(ids, 64, 16)
    assert int(n) == int(tn) and torch.equal(e, te)
    pairs = ids.numel()
    flat = ids.reshape(-1)
    real = s[: int(n)]
    assert sorted(real[real < pairs].tolist()) == list(range(pairs))  # every pair once (order may differ)
    assert bool((s[int(n):] == pairs).all())
    for blk in range(int(n) // 16):
        members = s[blk * 16:(blk + 1) * 16]
        members = members[members < pairs].long()
        assert members.numel() and bool((flat[members] == e[blk]).all())
