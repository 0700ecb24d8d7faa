"""Expert parallelism on the NVIDIA MoE ops: `experts` with -1 ids (pairs another rank computes) equals the native
op on the same pairs, in the direct mode (<= 64 pairs, fused combine) and the aligned mode, and the alignment
with -1 ids lays out the other experts' pairs exactly as without them. TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import DEVICE, backend, rel_err, tol  # noqa: I001  (sets TRITON_INTERPRET)

from deepinfer.backend import MoESpec, NativeMoE, RouterSpec


def _case(tokens: int, dtype, seed: int):
    router = RouterSpec(8, 2, "softmax", "greedy")
    spec = MoESpec(router=router, hidden_size=32, intermediate_size=16, num_local_experts=3)
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(3, 32, 32, generator=g) / 32**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(3, 32, 16, generator=g) / 16**0.5).to(DEVICE, dtype)
    x = torch.randn(tokens, 32, generator=g).to(DEVICE, dtype)
    ids = torch.randint(-1, 3, (tokens, 2), generator=g)
    ids[0] = -1  # a token none of whose experts is on this rank
    weights = torch.rand(tokens, 2, generator=g)
    return spec, w13, w2, x, ids.to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize("tokens", [3, 40])  # 6 pairs: direct mode; 80 pairs: aligned mode
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_experts_skip_minus_one_ids(tokens, dtype):
    spec, w13, w2, x, ids, weights = _case(tokens, dtype, seed=tokens)
    ours = backend().make_moe(spec)
    assert type(ours).__name__ == "TritonMoE" and ours.expert_parallel_reasons() == []
    ours.load_experts(w13, w2)
    ref = NativeMoE(spec)
    ref.load_experts(w13, w2)
    out, exp = ours.experts(x, weights, ids), ref.experts(x, weights, ids)
    assert out.shape == x.shape and bool((out[0] == 0).all())
    assert rel_err(out, exp) < 5 * tol(dtype)


def test_align_skipping_keeps_the_other_experts_layout():
    from deepinfer.backends.nvidia.fused_moe import align_skipping
    from deepinfer.backends.nvidia.moe_routing import moe_align

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 5, (11, 3), generator=g).to(DEVICE)
    skipped = ids.clone()
    skipped[ids == 4] = -1  # expert 4's pairs are another rank's: they must vanish, the rest stay put
    s_ids, s_exp, s_n = align_skipping(moe_align, skipped, 4, 4)
    r_ids, r_exp, r_n = moe_align(ids, 5, 4)
    live = int((r_exp[: int(r_n) // 4] < 4).sum()) * 4  # blocks of experts 0..3 come first in both
    assert torch.equal(s_ids[:live], r_ids[:live]) and torch.equal(s_exp[: live // 4], r_exp[: live // 4])
    assert bool((s_exp[live // 4:] == -1).all())  # the -1 bucket's blocks are skipped by the kernel
