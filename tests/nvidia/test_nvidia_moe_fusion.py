"""The fused MoE paths (SiLU in the gate_up epilogue, direct small-batch mode, combine kernel, shared experts
folded in as experts) against the native per-expert loop and a dense shared MLP, fp32 / fp16 / bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from nvidia_testutil import DEVICE, ON_GPU, backend, rel_err, tol  # noqa: I001  (sets TRITON_INTERPRET)

from deepinfer.backend import MoESpec, RouterSpec
from deepinfer.backend.native import NativeOps
from deepinfer.backend.native.activation import silu_and_mul
from deepinfer.backend.native.moe import experts_forward
from deepinfer.errors import BackendError

E, D, I, K = 8, 32, 24, 3  # tiny V2-Lite-like experts: E routed, top-K, hidden D, expert width I
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tol(dtype: torch.dtype) -> float:
    # bf16 under the interpreter: fp32 -> bf16 rounds toward zero (docs/performance.md, traps), ~3 roundings deep
    return 5 * tol(dtype)


def _weights(dtype, n_shared=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).to(DEVICE, dtype)
    gate_up = (torch.randn(2 * n_shared * I, D, generator=g) / D**0.5).to(DEVICE, dtype)
    down = (torch.randn(D, n_shared * I, generator=g) / (n_shared * I) ** 0.5).to(DEVICE, dtype)
    return w13, w2, gate_up, down


def _routing(t, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).to(DEVICE)
    return torch.rand(t, K, generator=g).to(DEVICE) + 0.1, ids


def _shared_mlp(gate_up, down):
    return lambda x: F.linear(silu_and_mul(F.linear(x, gate_up)), down)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("t", [1, 5])
def test_fused_moe_schedules_match_native(dtype, direct, t):
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    w13, w2, gate_up, down = _weights(dtype)
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    w, ids = _routing(t)
    ref = experts_forward(x, w13, w2, w, ids)
    out = fused_moe(x, w13, w2, w, ids, direct=direct)
    assert out.dtype == dtype and out.shape == (t, D)
    assert rel_err(out, ref) < _tol(dtype)
    if dtype == torch.float16 and not ON_GPU:  # interpreter, tiny K: same sums and roundings -> the native bits
        assert torch.equal(out, ref)
    shared = _shared_mlp(gate_up, down)(x)
    out = fused_moe(x, w13, w2, w, ids, shared_out=shared, direct=direct)
    assert rel_err(out, ref + shared) < _tol(dtype)
    if dtype == torch.float16 and not ON_GPU:
        assert torch.equal(out, ref + shared)  # sum -> round -> + shared -> round, as native + model


def test_duplicate_expert_pairs_and_repeated_tokens():
    """Many tokens on one expert (all rows of one direct program), some experts unused."""
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    w13, w2, _, _ = _weights(torch.float32)
    t = 12
    ids = torch.tensor([[0, 1, 2]] * 6 + [[2, 1, 0]] * 6, device=DEVICE)
    w = torch.rand(t, K, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ref = experts_forward(x, w13, w2, w, ids)
    for direct in (True, False):
        assert rel_err(fused_moe(x, w13, w2, w, ids, direct=direct), ref) < tol(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 4])
def test_shared_experts_folded_as_experts(dtype, t):
    """Direct mode with the shared MLP as 2 more experts of width I == routed experts + the dense MLP."""
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    w13, w2, gate_up, down = _weights(dtype)
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    w, ids = _routing(t, seed=6)
    ref = experts_forward(x, w13, w2, w, ids) + _shared_mlp(gate_up, down)(x)
    out = fused_moe(x, w13, w2, w, ids, shared_w=(gate_up, down), direct=True)
    assert out.dtype == dtype and rel_err(out, ref) < _tol(dtype)
    with pytest.raises(BackendError, match="direct mode"):
        fused_moe(x, w13, w2, w, ids, shared_w=(gate_up, down), direct=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [2, 30])  # 30 * 3 pairs > 64: the aligned schedule with the dense shared MLP
def test_triton_moe_op_with_shared_experts(dtype, t):
    """The op contract: fuse_shared_experts + forward(shared_experts=mlp) == native routed + mlp(x)."""
    spec = MoESpec(router=RouterSpec(E, K, "softmax", "greedy", routed_scaling_factor=2.0), hidden_size=D,
                   intermediate_size=I)
    w13, w2, gate_up, down = _weights(dtype)
    ours = backend().make_moe(spec)
    ours.load_experts(w13, w2)
    assert ours.fuse_shared_experts(gate_up, down) is True
    ref = NativeOps().make_moe(spec)
    ref.load_experts(w13, w2)
    assert ref.fuse_shared_experts(gate_up, down) is False
    g = torch.Generator().manual_seed(7)
    x = torch.randn(t, D, generator=g).to(DEVICE, dtype)
    logits = torch.randn(t, E, generator=g).to(DEVICE)
    calls = []

    def mlp(h):
        calls.append(h.shape[0])
        return _shared_mlp(gate_up, down)(h)

    out = ours.forward(x, logits, shared_experts=mlp)
    exp = ref.forward(x, logits, shared_experts=mlp)
    assert out.shape == (t, D) and out.dtype == dtype
    assert rel_err(out, exp) < _tol(dtype)
    assert calls == ([t] if t * K > 64 else []) + [t]  # folded at small batch: only the reference called it
    assert rel_err(ours.forward(x, logits), ref.forward(x, logits)) < _tol(dtype)  # no shared_experts: routed only


def test_fuse_shared_experts_checks_shapes():
    spec = MoESpec(router=RouterSpec(E, K, "softmax", "greedy"), hidden_size=D, intermediate_size=I)
    w13, w2, gate_up, down = _weights(torch.float32)
    op = backend().make_moe(spec)
    with pytest.raises(BackendError, match="before load_experts"):
        op.fuse_shared_experts(gate_up, down)
    op.load_experts(w13, w2)
    with pytest.raises(BackendError, match="not a shared MLP"):
        op.fuse_shared_experts(gate_up[:-1], down)
    assert op.fuse_shared_experts(gate_up.half(), down.half()) is False  # other dtype: the model's MLP runs


def test_direct_threshold_env(monkeypatch):
    from deepinfer.backends.nvidia.fused_moe import use_direct

    assert use_direct(10, 6) and not use_direct(11, 6) and not use_direct(0, 6)
    monkeypatch.setenv("DEEPINFER_MOE_DIRECT_MAX_PAIRS", "0")
    assert not use_direct(1, 6)
    monkeypatch.setenv("DEEPINFER_MOE_DIRECT_MAX_PAIRS", "many")
    with pytest.raises(BackendError, match="DEEPINFER_MOE_DIRECT_MAX_PAIRS"):
        use_direct(1, 6)


def test_combine_kernel():
    from deepinfer.backends.nvidia.fused_moe import combine

    g = torch.Generator().manual_seed(8)
    y = torch.randn(5, 4, 200, generator=g).to(DEVICE)
    shared = torch.randn(5, 200, generator=g).to(DEVICE, torch.float16)
    out = combine(y, shared, torch.float16)
    ref = y[:, 0] + y[:, 1] + y[:, 2] + y[:, 3]  # slot order, as the native sum over k on the CPU
    assert torch.equal(out, ref.half() + shared)
    assert rel_err(combine(y, None, torch.float32), y.sum(1)) < 1e-7  # fp32: only the summation order differs
    with pytest.raises(BackendError, match="shared output"):
        combine(y, shared[:, :10], torch.float16)


def test_router_gemv_token_limit_by_gate_size(monkeypatch):
    """The GEMV takes up to 512 tokens for V2-Lite's gate and smaller (timed against cuBLAS there), 64 for larger
    gates (V3's 256 x 7168: not timed); DEEPINFER_ROUTER_GEMV_MAX_TOKENS overrides both."""
    from deepinfer.backends.nvidia.moe_routing import _logits_gemv_max_tokens

    monkeypatch.delenv("DEEPINFER_ROUTER_GEMV_MAX_TOKENS", raising=False)
    assert _logits_gemv_max_tokens(64 * 2048) == 512 and _logits_gemv_max_tokens(67 * 300) == 512
    assert _logits_gemv_max_tokens(64 * 2048 + 1) == 64 and _logits_gemv_max_tokens(256 * 7168) == 64
    monkeypatch.setenv("DEEPINFER_ROUTER_GEMV_MAX_TOKENS", "0")
    assert _logits_gemv_max_tokens(64 * 2048) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3, 17, 65, 512, 513])  # 512: the GEMV's token limit (small gates); 513: cuBLAS
def test_router_logits_fp32_without_copy(dtype, t):
    spec = MoESpec(router=RouterSpec(E, K, "softmax", "greedy"), hidden_size=300, intermediate_size=I)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(t, 300, generator=g).to(DEVICE, dtype)
    gate = torch.randn(E + 3, 300, generator=g).to(DEVICE)  # E + 3: a partial expert block
    out = backend().make_moe(spec).router_logits(x, gate)
    ref = NativeOps().make_moe(spec).router_logits(x, gate)
    assert out.dtype == torch.float32 and out.shape == (t, E + 3)
    assert rel_err(out, ref) < 1e-6  # fp32 products of the same values; only the summation order differs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", ["none", "folded", "added"])
def test_direct_down_gemm_fuses_the_combine(dtype, shared):
    """The last program of each down-GEMM column combines: same bits as the combine kernel, counters reset."""
    from deepinfer.backends.nvidia.fused_moe import counters_for, fused_moe

    w13, w2, gate_up, down = _weights(dtype)
    t = 3
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(10)).to(DEVICE, dtype)
    w, ids = _routing(t, seed=11)
    kw = {"folded": {"shared_w": (gate_up, down)}, "added": {"shared_out": _shared_mlp(gate_up, down)(x)},
          "none": {}}[shared]
    counters = counters_for(D, DEVICE)
    unfused = fused_moe(x, w13, w2, w, ids, direct=True, **kw)
    for _ in range(2):  # a second launch reuses the counters (graph replay)
        fused = fused_moe(x, w13, w2, w, ids, direct=True, counters=counters, **kw)
        assert torch.equal(fused, unfused)
        assert int(counters.abs().sum()) == 0
    ref = experts_forward(x, w13, w2, w, ids)
    if shared != "none":
        ref = ref + _shared_mlp(gate_up, down)(x)
    assert rel_err(fused, ref) < _tol(dtype)


ROUTERS = {
    "softmax greedy": RouterSpec(E, K, "softmax", "greedy", routed_scaling_factor=2.0),
    "softmax group_limited_greedy": RouterSpec(16, 4, "softmax", "group_limited_greedy", n_group=4, topk_group=2,
                                               routed_scaling_factor=16.0),
    "sigmoid noaux_tc": RouterSpec(16, 4, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                                   routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_gate_route_fuses_router_gemv_and_topk(name):
    """One launch (per-token last program picks the experts) == router_logits then the Triton top-k.

    Every router at 7 tokens, launched twice (the counters reset). The 64-token limit (all 64 counters in
    use): on the GPU for every router, twice; under the interpreter once and for softmax greedy only, as
    the GEMV / counter / last-program logic does not depend on the router and each 64-token launch costs
    the interpreter ~10 s."""
    from deepinfer.backends.nvidia.moe_routing import gate_route, route, router_logits

    spec = ROUTERS[name]
    g = torch.Generator().manual_seed(12)
    x = torch.randn(7, 300, generator=g).to(DEVICE, torch.bfloat16)
    gate = torch.randn(spec.num_experts, 300, generator=g).to(DEVICE)
    bias = torch.randn(spec.num_experts, generator=g).to(DEVICE) if spec.topk_method == "noaux_tc" else None
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    x64 = torch.randn(64, 300, generator=g).to(DEVICE, torch.bfloat16)  # the most gate_route takes
    launches_64 = 2 if ON_GPU else 1
    cases = ((x, 1e-6, 2), (x64, 1e-5, launches_64))  # fp32 sums in another order; more rows, a looser bound
    if not ON_GPU and name != "softmax greedy":
        cases = cases[:1]
    for x, tol, launches in cases:
        for _ in range(launches):
            w, ids = gate_route(x, gate, spec, bias, counters)
            rw, rids = route(router_logits(x, gate), spec, bias)
            assert torch.equal(ids, rids) and torch.equal(w, rw)
            assert int(counters.abs().sum()) == 0
        nw, nids = NativeOps().route(F.linear(x.float(), gate), spec, bias)
        assert torch.equal(ids, nids) and rel_err(w, nw) < tol
    with pytest.raises(BackendError, match="gate_route"):
        gate_route(torch.zeros(65, 300, device=DEVICE), gate, spec, bias, counters)
    with pytest.raises(BackendError, match="gate_route"):  # more tokens than counters
        gate_route(torch.zeros(17, 300, device=DEVICE), gate, spec, bias, counters[:16])


@pytest.mark.parametrize("t", [1, 6, 17])  # 17: one past gate_route's 16 tokens: router GEMV, then the top-k
@pytest.mark.parametrize("name", ["softmax greedy", "sigmoid noaux_tc"])
def test_forward_hidden_matches_native(name, t):
    router = ROUTERS[name]
    spec = MoESpec(router=router, hidden_size=D, intermediate_size=I)
    w13, w2, gate_up, down = _weights(torch.float32)
    w13, w2 = w13[: router.num_experts], w2[: router.num_experts]
    if router.num_experts > E:
        w13, w2 = w13.repeat(2, 1, 1), w2.repeat(2, 1, 1)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(t, D, generator=g).to(DEVICE)
    gate = torch.randn(router.num_experts, D, generator=g).to(DEVICE)
    bias = torch.randn(router.num_experts, generator=g).to(DEVICE) if router.topk_method == "noaux_tc" else None
    ours, ref = backend().make_moe(spec), NativeOps().make_moe(spec)
    for op in (ours, ref):
        op.load_experts(w13, w2)
        op.fuse_shared_experts(gate_up, down)
    mlp = _shared_mlp(gate_up, down)
    out = ours.forward_hidden(x, gate, bias, mlp)
    assert rel_err(out, ref.forward_hidden(x, gate, bias, mlp)) < tol(torch.float32)
    assert rel_err(ours.forward_hidden(x, gate, bias), ref.forward_hidden(x, gate, bias)) < tol(torch.float32)
    assert int(ours.route_counters.abs().sum()) == 0 and int(ours.counters.abs().sum()) == 0


def test_bad_tile_env_names_the_variable(monkeypatch):
    from deepinfer.backends.nvidia.fused_moe_gemm import _tile_env
    from deepinfer.backends.nvidia.moe_routing import _gemv_tile

    monkeypatch.setenv("DEEPINFER_MOE_DIRECT_TILE", "64,128")
    with pytest.raises(BackendError, match="DEEPINFER_MOE_DIRECT_TILE"):
        _tile_env("DEEPINFER_MOE_DIRECT_TILE")
    monkeypatch.setenv("DEEPINFER_ROUTER_GEMV", "x")
    with pytest.raises(BackendError, match="DEEPINFER_ROUTER_GEMV"):
        _gemv_tile(2048)
