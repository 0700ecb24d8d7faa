"""The invariant kernels' fixed splits and layouts under the Triton interpreter, bitwise (tiny shapes, fp32 / fp16).

- gemm.py's K slices: the serial and the parallel schedule (per-slice programs, the last arrival folds) give
  the same bits, and a row alone equals the row inside batches of M in {1, 2, 3, 7, 64, 127, 128, 129}
  (the automatic schedule changes with M across those sizes);
- moe_align.py: every pair once, in its expert's run, in token order, blocks of one expert, shared experts'
  runs after the routed ones; one program and several programs give the same layout;
- the MoE with the shared experts folded into its grouped GEMMs: rows independent of the batch, both GEMM
  schedules equal, close to the native MoE plus the dense shared MLP; the -1 pairs of expert parallelism add
  nothing;
- the router: the top-k that sums the split gate's parts in its kernel equals the top-k of the summed logits.
"""

from nvidia_testutil import DEVICE  # noqa: I001  (sets TRITON_INTERPRET)

import pytest
import torch

from deepinfer.backend import MoESpec, RouterSpec
from deepinfer.backends.nvidia.invariant.gemm import bmm, linear, plan_for
from deepinfer.backends.nvidia.invariant.moe_align import align
from invariant_testutil import folded_shared_moe, rows_invariant

SIZES = (1, 2, 3, 7, 64, 127, 128, 129)
PROBE = (0, 1, 6, 63, 127, 128)


def _rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_slices_serial_equals_parallel_and_rows_do_not_depend_on_m(dtype):
    k = 72  # the interpreter's 32-deep slices: 32 + 32 + 8
    assert plan_for(1, 24, k, dtype).slices(k) == 3
    x, w = _rand(129, k, seed=1, dtype=dtype), _rand(24, k, seed=2, dtype=dtype, scale=0.2)
    for m in (1, 5, 17, 129):
        a = x[:m].unsqueeze(0)
        serial = bmm(a, w.t().unsqueeze(0), parallel=False)
        par = bmm(a, w.t().unsqueeze(0), parallel=True)
        assert torch.equal(serial, par), f"M={m}: the parallel schedule changed the bits"
        assert torch.equal(bmm(a, w.t().unsqueeze(0), parallel=True), par)  # the counters reset themselves
    rows_invariant(lambda a: linear(a, w), x, SIZES, PROBE)  # the automatic schedule (parallel: a tiny grid)
    serial = lambda a: bmm(a.unsqueeze(0), w.t().unsqueeze(0), parallel=False)[0]  # noqa: E731
    rows_invariant(serial, x, SIZES, PROBE)
    ref = x.double() @ w.double().T
    err = float((linear(x, w).double() - ref).norm() / ref.norm())
    assert err < (1e-6 if dtype == torch.float32 else 2e-3)


def test_gemm_batched_weights_and_a_single_slice():
    a, b = _rand(3, 9, 40, seed=3), _rand(3, 40, 20, seed=4)
    out = bmm(a, b, parallel=True)
    assert torch.equal(out, bmm(a, b, parallel=False))
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-5)
    a1, b1 = _rand(1, 5, 16, seed=5), _rand(1, 16, 8, seed=6)  # K = 16: one slice, no fold
    torch.testing.assert_close(bmm(a1, b1), a1 @ b1, rtol=1e-5, atol=1e-5)


def _check_layout(ids: torch.Tensor, num_experts: int, num_shared: int, bm: int):
    T, k = ids.shape
    slots = k + num_shared
    al = align(ids, num_experts, num_shared, bm)
    exp, rows, srt = al.block_expert.cpu(), al.block_rows.cpu(), al.sorted_ids.cpu()
    runs: dict[int, list[int]] = {}
    order = []
    for b in range(al.num_blocks):
        e, r = int(exp[b]), int(rows[b])
        if e < 0:
            assert r == 0
            continue
        assert 0 < r <= bm
        order.append(e)
        runs.setdefault(e, []).extend(srt[b * bm: b * bm + r].tolist())
    assert order == sorted(order), "runs are in expert order (shared experts last)"
    for e, pairs in runs.items():
        assert pairs == sorted(pairs), f"expert {e}'s pairs are not in token order"
        for p in pairs:
            t, j = divmod(p, slots)
            assert (int(ids[t, j]) if j < k else num_experts + j - k) == e
    placed = sorted(p for v in runs.values() for p in v)
    want = [t * slots + j for t in range(T) for j in range(slots) if j >= k or int(ids[t, j]) >= 0]
    assert placed == want, "every pair exactly once (-1 pairs left out)"
    return al


@pytest.mark.parametrize("num_shared", [0, 2])
def test_align_is_a_stable_counting_sort_in_one_or_many_programs(num_shared):
    g = torch.Generator().manual_seed(7)
    for T, k, E in ((1, 2, 8), (3, 6, 64), (129, 2, 8), (600, 2, 8)):  # 600 x 2 pairs: two programs
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        ids[torch.rand(T, k, generator=g) < 0.1] = -1
        al = _check_layout(ids.to(DEVICE), E, num_shared, 16)
        one = align(ids.to(DEVICE), E, num_shared, 16, programs=1)
        for name in ("sorted_ids", "block_expert", "block_rows"):
            got, want = getattr(one, name), getattr(al, name)
            if name == "sorted_ids":  # rows past a block's valid ones are never written
                valid = torch.arange(16)[None, :] < al.block_rows.cpu()[:, None]
                got, want = got.cpu().view(-1, 16)[valid], want.cpu().view(-1, 16)[valid]
            assert torch.equal(got.cpu(), want.cpu()), f"T={T}: one program and several differ in {name}"


def _moe(method: str = "greedy", num_experts: int = 8):
    noaux = method == "noaux_tc"
    router = RouterSpec(num_experts=num_experts, top_k=2, topk_method=method,
                        scoring_func="sigmoid" if noaux else "softmax", n_group=4 if noaux else 1,
                        topk_group=2 if noaux else 1, norm_topk_prob=noaux, routed_scaling_factor=2.5 if noaux else 1.0)
    # intermediate 32: the interpreter's 16-deep K slices cut both GEMMs (K = 32) in two
    spec = MoESpec(router=router, hidden_size=32, intermediate_size=32)
    w13, w2 = _rand(num_experts, 64, 32, seed=8, scale=0.2), _rand(num_experts, 32, 32, seed=9, scale=0.2)
    gate_up, down = _rand(128, 32, seed=10, scale=0.2), _rand(32, 64, seed=11, scale=0.2)  # 2 shared experts
    return folded_shared_moe(spec, w13, w2, gate_up, down)


@pytest.mark.parametrize("method", ["greedy", "noaux_tc"])
def test_moe_with_shared_experts_folded_in_rows_do_not_depend_on_the_batch(method):
    inv, ref, shared = _moe(method)
    gate, bias = _rand(8, 32, seed=12), _rand(8, seed=13, scale=0.1)
    cb = bias if method == "noaux_tc" else None
    x = _rand(129, 32, seed=14)
    # the interpreter is slow: the tile edges (64, 128) once, with rows on both sides of them, for greedy; ragged
    # small sizes for noaux_tc (the full SIZES x PROBE took ~40 s here); both end at the whole batch (129 rows),
    # whose run the comparison with the native op below reuses
    sizes = (1, 3, 64, 127, 129) if method == "greedy" else (1, 7, 64, 129)
    outs = rows_invariant(lambda a: inv.forward_hidden(a, gate, cb, shared_experts=shared), x, sizes, (0, 6, 63, 128))
    got = outs[len(x)]
    torch.testing.assert_close(got, ref.forward_hidden(x, gate, cb, shared_experts=shared), rtol=1e-4, atol=1e-5)


def test_moe_gemm_schedules_agree_and_unrouted_pairs_add_nothing():
    from deepinfer.backends.nvidia.invariant import moe_gemm

    inv, ref, _ = _moe()
    x = _rand(7, 32, seed=15)
    weights, ids = inv.route(linear(x, _rand(8, 32, seed=16), out_dtype=torch.float32))
    E, k = 8, 2
    al = align(ids, E, 2, 16)
    outs = []
    for parallel in (False, True):
        act = torch.empty((7 * 4, 32), device=DEVICE)
        moe_gemm.aligned_gemm(x, inv.w13, act, al, 16, k, 4, 4, shared_w=inv.shared_w[0], dual=True,
                              parallel=parallel)
        y = torch.empty((7 * 4, 32), device=DEVICE)
        moe_gemm.aligned_gemm(act, inv.w2, y, al, 16, k, 4, 1, shared_w=inv.shared_w[1], topk_weights=weights,
                              parallel=parallel)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]), "the parallel K slices changed the bits"
    # expert parallelism's entry: -1 pairs (another rank's experts) contribute nothing, the rest as always
    ids_ep = ids.clone()
    ids_ep[::2, 1] = -1
    torch.testing.assert_close(inv.experts(x, weights, ids_ep), ref.experts(x, weights, ids_ep), rtol=1e-4, atol=1e-5)


def test_router_top_k_on_the_split_gate_parts_equals_top_k_of_the_summed_logits():
    from deepinfer.backends.nvidia.invariant.router import route_parts, router_linear, router_parts, split_gate
    from deepinfer.backends.nvidia.moe_routing import route

    inv, _, _ = _moe("noaux_tc")
    x = _rand(17, 32, seed=17, dtype=torch.bfloat16)
    parts = split_gate(_rand(8, 32, seed=18))
    bias = _rand(8, seed=19, scale=0.1)
    w1, i1 = route_parts(router_parts(x, parts), inv.spec.router, bias)
    w2, i2 = route(router_linear(x, parts), inv.spec.router, bias)
    assert torch.equal(i1, i2) and torch.equal(w1, w2)
