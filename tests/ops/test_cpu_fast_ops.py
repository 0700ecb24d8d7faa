"""The cpu backend's CPU-specific ops against the native reference ops they stand beside.

Every path of each op on tiny shapes: MoE pair-by-pair (<= PAIRS_MAX pairs), dense over every
expert, and the native loop above the work threshold, with and without fused shared experts;
MLA with the decode rows batched (decode-only, mixed with prefill, split cache layout, a plan
shared by two layers); linears with the transposed weight; the thread setting's rules.
No timings here: speed is measured by benchmarks/cpu_side_by_side.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer import envs
from deepinfer.backend import ForwardBatch, MLASpec, MoESpec, NativeOps, RouterSpec
from deepinfer.backends.cpu import ops_moe
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.backends.cpu.ops_linear import TransposedWeightLinear
from deepinfer.backends.cpu.ops_mla import CPUMLAAttention, PlanCache
from deepinfer.backends.cpu.ops_moe import CPUMoE
from deepinfer.backends.cpu.threads import wanted_threads

NATIVE = NativeOps()
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}

ROUTERS = {
    "v3": RouterSpec(16, 2, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                     routed_scaling_factor=2.5),
    "v2-lite": RouterSpec(8, 3, "softmax", "greedy"),
    "hash": RouterSpec(8, 2, "sqrtsoftplus", "hash", norm_topk_prob=True, routed_scaling_factor=1.5),
}


def _close(a, b, dtype):
    atol, rtol = TOL[dtype]
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


# ------------------------------------------------------------------ MoE


def _moe_inputs(rspec, t, d, inter, n_shared, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = rspec.num_experts
    x = torch.randn(t, d, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, d, generator=g) * d**-0.5).to(dtype)
    w2 = (torch.randn(e, d, inter, generator=g) * inter**-0.5).to(dtype)
    logits = torch.randn(t, e, generator=g) * 2
    bias = torch.randn(e, generator=g) * 0.1 if rspec.topk_method == "noaux_tc" else None
    tokens = tid2eid = None
    if rspec.topk_method == "hash":
        tokens = torch.randint(0, 32, (t,), generator=g)
        tid2eid = torch.randint(0, e, (32, rspec.top_k), generator=g)
        tid2eid[0] = 3  # token 0 routed twice to one expert: the combine must add both slots
        tokens[0] = 0
    gate_up = (torch.randn(2 * n_shared * inter, d, generator=g) * d**-0.5).to(dtype) if n_shared else None
    down = (torch.randn(d, n_shared * inter, generator=g) * (n_shared * inter) ** -0.5).to(dtype) if n_shared else None
    return x, w13, w2, logits, bias, tokens, tid2eid, gate_up, down


def _run_moe(op, inputs, fuse):
    x, w13, w2, logits, bias, tokens, tid2eid, gate_up, down = inputs
    op.load_experts(w13, w2)
    shared = None
    if gate_up is not None:
        if fuse:
            op.fuse_shared_experts(gate_up, down)

        def shared(h):
            return F.linear(NATIVE.silu_and_mul(F.linear(h, gate_up)), down)
    return op.forward(x, logits, bias, tokens, tid2eid, shared_experts=shared)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("t, path", [(1, "pairs"), (2, "pairs"), (9, "dense"), (40, "loop")])
@pytest.mark.parametrize("n_shared", [0, 1, 2])
def test_moe_paths_match_native(dtype, router, t, path, n_shared, monkeypatch):
    rspec = ROUTERS[router]
    d, inter = 32, 16
    spec = MoESpec(router=rspec, hidden_size=d, intermediate_size=inter)
    max_work = 10 * (rspec.num_experts + n_shared) * inter * d  # dense up to 10 tokens
    pairs = t * rspec.top_k <= ops_moe.PAIRS_MAX
    if path == "pairs" and not pairs:
        monkeypatch.setattr(ops_moe, "PAIRS_MAX", t * rspec.top_k)
    inputs = _moe_inputs(rspec, t, d, inter, n_shared, dtype)
    op = CPUMoE(spec, route_fn=NATIVE.route, silu_and_mul=NATIVE.silu_and_mul, dense_max_work=max_work)
    ref = _run_moe(NATIVE.make_moe(spec), inputs, fuse=False)
    for fuse in (False, True):
        out = _run_moe(CPUMoE(spec, route_fn=NATIVE.route, silu_and_mul=NATIVE.silu_and_mul,
                              dense_max_work=max_work), inputs, fuse)
        _close(out, ref, dtype)
    x = inputs[0]
    op.load_experts(inputs[1], inputs[2])
    assert (t * rspec.top_k <= ops_moe.PAIRS_MAX) == (path == "pairs")
    if path != "pairs":
        assert op.dense_ok(x) == (path == "dense")


def test_moe_swiglu_limit_and_fp16_take_the_native_way():
    rspec = ROUTERS["v3"]
    spec = MoESpec(router=rspec, hidden_size=32, intermediate_size=16, swiglu_limit=0.5)
    for dtype, t in ((torch.float32, 9), (torch.float32, 1), (torch.float16, 9)):
        inputs = _moe_inputs(rspec, t, 32, 16, 0, dtype, seed=3)
        op = CPUMoE(spec, route_fn=NATIVE.route, silu_and_mul=NATIVE.silu_and_mul, dense_max_work=1 << 30)
        out = _run_moe(op, inputs, fuse=True)
        ref = _run_moe(NATIVE.make_moe(spec), inputs, fuse=False)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)
        if dtype == torch.float16:
            assert not op.dense_ok(inputs[0])  # fp16: an unchosen expert's inf * 0 would be NaN


def test_moe_large_experts_keep_no_dense_copy():
    spec = MoESpec(router=ROUTERS["v3"], hidden_size=32, intermediate_size=16)
    inputs = _moe_inputs(ROUTERS["v3"], 4, 32, 16, 0, torch.float32)
    op = CPUMoE(spec, route_fn=NATIVE.route, silu_and_mul=NATIVE.silu_and_mul, dense_max_work=100)
    op.load_experts(inputs[1], inputs[2])
    assert op.w13_all is None and not op.dense_ok(inputs[0])


# ------------------------------------------------------------------ MLA

H, NOPE, ROPE, V, L, BS = 3, 8, 4, 6, 16, 16
SPEC = MLASpec(num_heads=H, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, kv_lora_rank=L,
               softmax_scale=0.3)


def _batch(qlens, ctxs, g, num_blocks):
    seqs = [q + c for q, c in zip(qlens, ctxs)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    rows, start = [], 0
    for s in seqs:
        n = -(-s // BS)
        rows.append(perm[start : start + n])
        start += n
    width = max(len(r) for r in rows) + 1  # one spare -1 column, as a table wider than needed
    slots, positions = [], []
    for q, c, row in zip(qlens, ctxs, rows):
        for p in range(c, c + q):
            slots.append(row[p // BS] * BS + p % BS)
            positions.append(p)
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    return ForwardBatch(
        input_ids=torch.zeros(sum(qlens), dtype=torch.long), positions=torch.tensor(positions),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seqs, dtype=torch.int32),
        context_lens=torch.tensor(ctxs, dtype=torch.int32),
        block_tables={"mla": torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)},
        slot_mapping={"mla": torch.tensor(slots, dtype=torch.long)},
        logits_indices=torch.tensor(qsl[1:]) - 1, query_lens_cpu=list(qlens), seq_lens_cpu=seqs,
        context_lens_cpu=list(ctxs), block_size=BS,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qlens, ctxs", [([1, 1, 1, 1], [0, 15, 16, 40]), ([5, 1, 3, 1], [0, 12, 17, 33]),
                                          ([7], [0]), ([1], [100])])
@pytest.mark.parametrize("split", [False, True])
def test_mla_batched_decode_matches_native(dtype, qlens, ctxs, split):
    g = torch.Generator().manual_seed(sum(qlens) + sum(ctxs))
    t, nb = sum(qlens), sum(-(-(q + c) // BS) for q, c in zip(qlens, ctxs)) + 3
    batch = _batch(qlens, ctxs, g, nb)
    kv_b = (torch.randn(H * (NOPE + V), L, generator=g) * L**-0.5).to(dtype)
    q = torch.randn(t, H, NOPE + ROPE, generator=g).to(dtype)
    kv_c = torch.randn(t, L, generator=g).to(dtype)
    k_pe = torch.randn(t, ROPE, generator=g).to(dtype)
    plans = PlanCache()
    outs, caches = [], []
    for op in (NATIVE.make_mla_attention(SPEC), CPUMLAAttention(SPEC, plans), CPUMLAAttention(SPEC, plans)):
        cache = (torch.randn(nb, BS, L + ROPE, generator=torch.Generator().manual_seed(7)) * 0.5).to(dtype)
        view = (cache[..., :L].contiguous(), cache[..., L:].contiguous()) if split and not \
            isinstance(op, type(NATIVE.make_mla_attention(SPEC))) else cache
        op.load_kv_b_proj(kv_b)
        outs.append(op.forward(q, kv_c, k_pe, view, batch, "mla"))
        caches.append(torch.cat(view, dim=-1) if isinstance(view, tuple) else view)
    ref, a, b = outs
    _close(a, ref, dtype)
    _close(b, ref, dtype)  # the second layer reuses the first one's plan
    assert torch.equal(caches[1], caches[0]) and torch.equal(caches[2], caches[0])  # the writes, exact


def test_mla_refuses_a_table_that_does_not_cover_a_sequence():
    g = torch.Generator().manual_seed(0)
    batch = _batch([1, 1], [20, 3], g, 8)
    batch.block_tables["mla"][0, 1] = -1  # request 0 needs two blocks
    op = CPUMLAAttention(SPEC)
    op.load_kv_b_proj(torch.randn(H * (NOPE + V), L))
    with pytest.raises(Exception, match="do not cover"):
        op.forward(torch.randn(2, H, NOPE + ROPE), torch.randn(2, L), torch.randn(2, ROPE),
                   torch.zeros(8, BS, L + ROPE), batch, "mla")


def test_mla_padding_slots_are_not_written():
    g = torch.Generator().manual_seed(1)
    batch = _batch([1, 1], [4, 9], g, 4)
    batch.slot_mapping["mla"][1] = -1
    cache = torch.zeros(4, BS, L + ROPE)
    ref_cache = cache.clone()
    kv_b = torch.randn(H * (NOPE + V), L)
    q, kv_c, k_pe = torch.randn(2, H, NOPE + ROPE), torch.randn(2, L), torch.randn(2, ROPE)
    for op, c in ((CPUMLAAttention(SPEC), cache), (NATIVE.make_mla_attention(SPEC), ref_cache)):
        op.load_kv_b_proj(kv_b)
        op.forward(q, kv_c, k_pe, c, batch, "mla")
    assert torch.equal(cache, ref_cache)


# ------------------------------------------------------------------ linears


class _Layer(torch.nn.Module):
    def __init__(self, w, b=None, scale=None):
        super().__init__()
        self.weight, self.bias, self.weight_scale_inv = w, b, scale


@pytest.mark.parametrize("scheme", ["none", "fp8_block"])
def test_transposed_linear_matches_native(scheme):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 136, generator=g)
    scale = None
    if scheme == "fp8_block":
        scale = torch.rand(2, 2, generator=g) + 0.5
        w = w.to(torch.float8_e4m3fn)
    b = torch.randn(200, generator=g)
    x = torch.randn(5, 136, generator=g)
    ref_layer, layer = _Layer(w.clone(), b.clone(), scale), _Layer(w.clone(), b.clone(), scale)
    native = NATIVE.linear_method(scheme)
    native.process_weights(ref_layer, torch.float32)
    method = TransposedWeightLinear(NATIVE.linear_method(scheme))
    method.process_weights(layer, torch.float32)
    assert method.scheme == scheme and layer.weight.shape == (200, 136) and layer.weight.t().is_contiguous()
    assert torch.equal(method.dense_weight(layer), native.dense_weight(ref_layer))
    torch.testing.assert_close(method.apply(layer, x), native.apply(ref_layer, x), atol=1e-5, rtol=1e-5)
    method.process_weights(layer, torch.float32)  # again: still a view of one [in, out] copy
    assert layer.weight.t().is_contiguous()


# ------------------------------------------------------------------ the backend: wiring, threads


def test_backend_uses_the_cpu_ops_unless_told_not_to(monkeypatch):
    spec = MoESpec(router=ROUTERS["v3"], hidden_size=32, intermediate_size=16)
    be = CPUBackend()
    assert isinstance(be.make_moe(spec), CPUMoE) and isinstance(be.make_mla_attention(SPEC), CPUMLAAttention)
    assert be.op_coverage()["moe"].startswith("cpu") and be.op_coverage()["mla_attention"].startswith("cpu")
    monkeypatch.setenv(envs.CPU_FAST_OPS.name, "0")
    native = CPUBackend()
    assert type(native.make_moe(spec)) is type(NATIVE.make_moe(spec))
    assert native.op_coverage()["moe"] == "native"


def test_thread_rules(monkeypatch):
    monkeypatch.delenv(envs.CPU_THREADS.name, raising=False)
    monkeypatch.delenv(envs.OMP_NUM_THREADS.name, raising=False)
    assert wanted_threads() == 1
    monkeypatch.setenv(envs.OMP_NUM_THREADS.name, "2")
    assert wanted_threads() is None  # the user's OpenMP setting stands
    monkeypatch.setenv(envs.CPU_THREADS.name, "3")
    assert wanted_threads() == 3
    monkeypatch.setenv(envs.CPU_THREADS.name, "0")
    assert wanted_threads() is None


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_from_latent_matches_native(interleaved, dtype):
    from deepinfer.backend.native import rope_cos_sin_cache

    g = torch.Generator().manual_seed(5)
    qlens, ctxs = [1, 4, 1], [3, 0, 30]
    t, nb = sum(qlens), 8
    batch = _batch(qlens, ctxs, g, nb)
    kv_b = (torch.randn(H * (NOPE + V), L, generator=g) * L**-0.5).to(dtype)
    q = torch.randn(t, H, NOPE + ROPE, generator=g).to(dtype)
    kv_a = (torch.randn(t, L + ROPE, generator=g) * 2).to(dtype)
    w = (torch.randn(L, generator=g) * 0.5 + 1).to(dtype)
    rope = rope_cos_sin_cache(ROPE, 256, 10000.0, {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                                                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    outs, caches = [], []
    for op in (NATIVE.make_mla_attention(SPEC), CPUMLAAttention(SPEC)):
        op.load_kv_b_proj(kv_b)
        cache = torch.zeros(nb, BS, L + ROPE, dtype=dtype)
        outs.append(op.forward_from_latent(q.clone(), kv_a, w, 1e-6, batch.positions, rope, interleaved, cache,
                                           batch, "mla", NATIVE))
        caches.append(cache)
    _close(outs[1], outs[0], dtype)
    _close(caches[1], caches[0], dtype)
