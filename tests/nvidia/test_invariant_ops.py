"""The nvidia backend's batch-invariant kernels (deepinfer/backends/nvidia/invariant/), bitwise per row.

Under the Triton interpreter at tiny shapes (its tiles are 16 rows: the sizes cross them), on a GPU at
the same shapes with the GPU tiles. Row i of an op computed alone equals row i inside batches of M
rows; a token's MLA output is the same bits in one prefill, in uneven chunks, decoded one at a time
(with either schedule), or beside other sequences; each op stays close to the torch-native oracle.
Under the interpreter the products run in fp64 (gemm.mma says why), so these check the kernels'
schedule (tiles, splits, masks, the fold order), not the GPU's MMA; test_invariant_gpu.py does that.
"""

from nvidia_testutil import DEVICE, ON_GPU, backend, rel_err  # noqa: I001  (sets TRITON_INTERPRET)

import pytest
import torch
import torch.nn.functional as F

from deepinfer.backend import MLASpec, MoESpec, RouterSpec
from deepinfer.backend.native.mla_attention import NativeMLAAttention
from deepinfer.backend.native.moe import NativeMoE
from deepinfer.backend.native.norm import add_rms_norm, rms_norm
from deepinfer.backends.nvidia.invariant.gemm import bmm, linear
from deepinfer.backends.nvidia.invariant.mla import InvariantMLAAttention
from deepinfer.backends.nvidia.invariant.moe import InvariantMoE
from deepinfer.errors import BackendError
from invariant_testutil import PagedCache, rows_invariant, seq_inputs

SIZES = (1, 2, 3, 7, 17, 33)  # the interpreter's GEMM tile is 16 rows
PROBE = (0, 6, 16)


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_do_not_depend_on_m(dtype):
    x, w = _rand(33, 40, seed=1, dtype=dtype), _rand(24, 40, seed=2, dtype=dtype)
    rows_invariant(lambda a: linear(a, w), x, SIZES, PROBE)
    ref = x.double() @ w.double().T
    assert rel_err(linear(x, w), ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    # the router's mixed case: bf16 activations times the fp32 gate, fp32 out, exact fp32 products
    gate = _rand(8, 40, seed=3)
    logits = linear(x, gate, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    assert rel_err(logits, x.double() @ gate.double().T) < 1e-6
    rows_invariant(lambda a: linear(a, gate, out_dtype=torch.float32), x, SIZES, PROBE)


def test_router_on_a_split_gate_is_exact_and_invariant():
    """bf16 x times an fp32 gate split into three bf16 parts: the parts add back to the gate bit for bit, and
    the logits are the exact-product fp32 dot (to fp32 rounding) and do not depend on the batch."""
    from deepinfer.backends.nvidia.invariant.router import router_linear, split_gate

    x = _rand(33, 40, seed=1, dtype=torch.bfloat16)
    gate = _rand(8, 40, seed=3) * torch.logspace(-30, 30, 40, base=2.0).to(DEVICE)  # exponents far apart
    parts = split_gate(gate)
    assert parts.dtype == torch.bfloat16 and parts.shape == (24, 40)
    hi, mid, lo = parts.float().split(8)
    assert torch.equal((hi + mid) + lo, gate)
    logits = router_linear(x, parts)
    assert logits.dtype == torch.float32 and logits.shape == (33, 8)
    assert rel_err(logits, x.double() @ gate.double().T) < 1e-6
    rows_invariant(lambda a: router_linear(a, parts), x, SIZES, PROBE)
    with pytest.raises(BackendError, match="invariant router"):
        router_linear(x.float(), parts)


def test_bmm_strided_views():
    a, b = _rand(3, 17, 24, seed=4), _rand(3, 20, 24, seed=5)
    out = torch.empty(17, 3, 20, device=DEVICE)  # [M, heads, N] memory written through a [heads, M, N] view
    bmm(a.transpose(0, 1).contiguous().transpose(0, 1), b.transpose(1, 2), out=out.transpose(0, 1))
    assert rel_err(out.transpose(0, 1), a.double() @ b.double().transpose(1, 2)) < 1e-6
    with pytest.raises(BackendError, match="do not chain"):
        bmm(a, b)


def test_row_ops_of_the_default_kernels_are_invariant():
    """RMSNorm / add+RMSNorm (one row per program) and SiLU-and-mul (elementwise) are on the invariant path as
    they stand."""
    be = backend()
    x, w = _rand(33, 48, seed=6), _rand(48, seed=7).abs() + 0.5
    sizes, probe = (1, 7, 17, 33), (0, 16)
    rows_invariant(lambda a: be.rms_norm(a, w, 1e-6), x, sizes, probe)
    rows_invariant(lambda a: be.add_rms_norm(a, a * 0.5, w, 1e-6)[0], x, sizes, probe)
    rows_invariant(be.silu_and_mul, x, sizes, probe)
    torch.testing.assert_close(be.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    torch.testing.assert_close(be.add_rms_norm(x, x * 0.5, w, 1e-6)[0], add_rms_norm(x, x * 0.5, w, 1e-6)[0])
    torch.testing.assert_close(be.silu_and_mul(x), F.silu(x[:, :24]) * x[:, 24:])


def _moe_spec(method: str) -> MoESpec:
    noaux = method == "noaux_tc"
    router = RouterSpec(num_experts=8, top_k=2, topk_method=method, scoring_func="sigmoid" if noaux else "softmax",
                        n_group=4 if noaux else 1, topk_group=2 if noaux else 1, norm_topk_prob=noaux,
                        routed_scaling_factor=2.5 if noaux else 1.0)
    return MoESpec(router=router, hidden_size=32, intermediate_size=16)


@pytest.mark.parametrize("method", ["greedy", "noaux_tc"])
def test_moe_rows_do_not_depend_on_the_batch(method):
    spec = _moe_spec(method)
    w13, w2 = _rand(8, 32, 32, seed=8) * 0.2, _rand(8, 32, 16, seed=9) * 0.2
    gate, bias = _rand(8, 32, seed=10), _rand(8, seed=11) * 0.1
    cb = bias if method == "noaux_tc" else None
    inv, ref = InvariantMoE(spec), NativeMoE(spec)
    inv.load_experts(w13, w2)
    ref.load_experts(w13, w2)
    x = _rand(17, 32, seed=12)
    rows_invariant(lambda a: inv.forward_hidden(a, gate, cb, shared_experts=lambda t: t * 0.25), x,
                   (1, 3, 17), (0, 16))
    torch.testing.assert_close(inv.forward_hidden(x, gate, cb), ref.forward_hidden(x, gate, cb), rtol=1e-4, atol=1e-5)


SPEC = MLASpec(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
               softmax_scale=0.17)
PAGE = 8


def _mla(cls, two_stage=None):
    op = cls(SPEC)
    op.load_kv_b_proj(_rand(SPEC.num_heads * 32, SPEC.kv_lora_rank, seed=13) * 0.2)
    if two_stage is not None:
        op.two_stage = two_stage
    return op


def _cache(dtype):
    return PagedCache(SPEC, PAGE, 6, 4, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32])  # bf16: test_invariant_gpu.py (the interpreter is slow)
def test_mla_token_bits_independent_of_chunking_decode_schedule_and_batch(dtype):
    """24 tokens (the interpreter's split is 16 entries: two splits): one prefill == uneven chunks == one
    token at a time (two-stage and one-stage decode) == beside other sequences."""
    op = _mla(InvariantMLAAttention)
    q, kv, pe = seq_inputs(SPEC, 24, 0, dtype, DEVICE)
    whole = _cache(dtype).run(op, [(0, q, kv, pe)])[0]
    c = _cache(dtype)
    chunked = torch.cat([c.run(op, [(0, q[a:b], kv[a:b], pe[a:b])])[0] for a, b in ((0, 1), (1, 15), (15, 24))])
    assert torch.equal(chunked, whole)
    for two_stage in (True, False):
        c = _cache(dtype)
        c.run(op, [(0, q[:17], kv[:17], pe[:17])])
        dec = _mla(InvariantMLAAttention, two_stage)
        steps = [c.run(dec, [(0, q[j:j + 1], kv[j:j + 1], pe[j:j + 1])])[0] for j in (17, 18)]
        assert torch.equal(torch.cat(steps), whole[17:19]), f"decode (two_stage={two_stage}) != prefill"
    c = _cache(dtype)
    a, b = seq_inputs(SPEC, 5, 1, dtype, DEVICE), seq_inputs(SPEC, 3, 2, dtype, DEVICE)
    c.run(op, [(1, *a), (2, *(t[:2] for t in b))])
    mixed = c.run(op, [(2, *(t[2:3] for t in b)), (0, q, kv, pe), (1, *(t[:1] for t in seq_inputs(SPEC, 1, 3, dtype,
                                                                                                    DEVICE)))])
    assert torch.equal(mixed[1], whole)
    ref = _cache(dtype).run(_mla(NativeMLAAttention), [(0, q, kv, pe)])[0]
    assert rel_err(whole, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_mla_from_latent_fused_prep_is_invariant_and_equals_the_default_composition():
    """forward_from_latent (mla_prep: norm + RoPE + KV write + W_UK absorb in one launch, then the invariant
    attention): a token's bits are the same in one prefill, in chunks, or decoded (DECODE mode: no q-block
    tables), and the same as the base class's op-by-op composition with this backend's norm, RoPE and invariant
    bmm (mla_prep rounds alike)."""
    from deepinfer.backend.layer_ops import MLAAttentionOp
    from deepinfer.backend.native.rope import rope_cos_sin_cache

    be = backend()
    n, rope = 20, SPEC.qk_rope_head_dim
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n, SPEC.num_heads, SPEC.qk_nope_head_dim + rope, generator=g).to(DEVICE)
    kv_a = torch.randn(n, SPEC.kv_lora_rank + rope, generator=g).to(DEVICE)
    w = (torch.randn(SPEC.kv_lora_rank, generator=g) * 0.5 + 1).to(DEVICE)
    cs = rope_cos_sin_cache(rope, 64, 10000.0, None).to(DEVICE)
    op = _mla(InvariantMLAAttention)

    def run(c, a, b, fused=True):
        batch = c.batch([(0, b - a)])
        f = op.forward_from_latent if fused else (lambda *args: MLAAttentionOp.forward_from_latent(op, *args))
        return f(q[a:b].clone(), kv_a[a:b], w, 1e-6, batch.positions, cs, True, c.kv, batch, "mla", be)

    whole = run(_cache(torch.float32), 0, n)
    composed = run(_cache(torch.float32), 0, n, fused=False)
    # the same products either way; one rounding here (K = 16 is one step of both), on a GPU the compiled
    # kernels may chain their MMA steps differently, so close there
    assert torch.equal(whole, composed) if not ON_GPU else rel_err(whole, composed) < 1e-5
    c = _cache(torch.float32)
    steps = [run(c, a, b) for a, b in ((0, 7), (7, 17), (17, 18), (18, 19), (19, 20))]
    assert torch.equal(torch.cat(steps), whole)


@pytest.mark.parametrize("qlens,ctxs,bq", [([5, 1, 4, 1], [3, 6, 0, 37], 1), ([5, 1, 4, 1, 9], [3, 6, 0, 37, 2], 4),
                                           ([17, 3], [0, 5], 16)])
def test_qblocks_host_matches_the_per_token_loop(qlens, ctxs, bq):
    """The vectorised q-block tables (one build per step, ForwardBatch.memo) equal the plain loop's."""
    from deepinfer.backends.nvidia.invariant.mla import qblocks_host

    want = [[], [], [], []]
    start = 0
    for i, (n, ctx) in enumerate(zip(qlens, ctxs)):
        for j in range(0, n, bq):
            for col, v in zip(want, (start + j, min(bq, n - j), i, ctx + j)):
                col.append(v)
        start += n
    got = qblocks_host(qlens, ctxs, torch.device("cpu"), bq)
    assert [t.tolist() for t in got] == want and all(t.dtype == torch.int32 for t in got)


def test_backend_hands_out_invariant_ops():
    be = backend()
    assert be.caps.batch_invariant and be.caps.batch_invariant_model_types == ("deepseek_v2", "deepseek_v3")
    assert type(be.make_mla_attention(SPEC)).__name__ == "TritonMLAAttention"
    be.enable_batch_invariance()
    assert isinstance(be.make_mla_attention(SPEC), InvariantMLAAttention)
    assert isinstance(be.make_moe(_moe_spec("greedy")), InvariantMoE)
    assert type(be.linear_method("none")).__name__ == "InvariantLinear"
    assert type(be.linear_method("fp8_block")).__name__ == "InvariantLinear"
    assert "batch-invariant" in be.op_coverage()["moe"]
    v4 = MoESpec(router=_moe_spec("greedy").router, hidden_size=32, intermediate_size=16, swiglu_limit=7.0)
    with pytest.raises(BackendError, match="batch-invariant MoE"):
        be.make_moe(v4)
