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


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="real shapes need the GPU")
@pytest.mark.parametrize("scheme", ["fp8_block", "fp4", "int4_awq"])
def test_fused_moe_quantized_real_shapes(scheme):
    """V3-like experts (D 7168, I 256 per rank share, 16 local experts) in bf16 against the dense twin."""
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    q, w13, w2 = make_experts(scheme, 256, device=DEVICE, num_experts=16, hidden=7168)
    for t in (1, 64, 300):
        x = torch.randn(t, 7168, device=DEVICE).bfloat16()
        wts, ids = routing(t, k=8, drop=True, device=DEVICE, num_experts=16)
        got = fused_moe(x, q.w13, q.w2, wts, ids, skip_unrouted=True, scheme=scheme, w13_scale=q.w13_scale,
                        w2_scale=q.w2_scale, **int4_args(q))
        ref = experts_forward(x, w13.bfloat16(), w2.bfloat16(), wts, ids)
        assert (got.float() - ref.float()).norm() / ref.float().norm() < 2e-2
