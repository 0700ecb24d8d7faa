"""The batch-invariant kernels on the GPU at DeepSeek-V2-Lite shapes, bitwise per row (bf16).

hidden 2048, 16 heads, kv_lora 512, rope 64, 64 experts top-6 (moe_intermediate 1408, 2 shared experts),
lm_head 102400; row i alone equals row i inside batches of M in {1, 2, 3, 7, 64, 127, 128, 129, 1024}; the
GEMMs' and the grouped GEMMs' fixed K slices give the same bits folded serially or by per-slice programs; MLA
over contexts crossing the 128-entry split: one prefill == chunks == decode (both schedules); a CUDA graph
captured at a padded bucket gives eager's bits. Each op close to an fp32 / fp64 reference.

  python -m pytest -q tests/nvidia/test_invariant_gpu.py
"""

from nvidia_testutil import rel_err  # noqa: I001  (sets TRITON_INTERPRET off the GPU)

import pytest
import torch

from deepinfer.backend import MLASpec, MoESpec, RouterSpec
from deepinfer.backend.native.mla_attention import NativeMLAAttention
from deepinfer.backend.native.moe import NativeMoE
from invariant_testutil import PagedCache, folded_shared_moe, rows_invariant, seq_inputs

pytestmark = pytest.mark.gpu

SIZES = (1, 2, 3, 7, 64, 127, 128, 129, 1024)
PROBE = (0, 1, 6, 63, 64, 127, 128)
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _rand(*shape, seed=0, dtype=BF16, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


@pytest.mark.parametrize("n,k", [(3648, 2048), (2048, 2048), (2816, 2048), (2048, 1408), (102400, 2048)])
def test_gemm_rows_do_not_depend_on_m(n, k):
    from deepinfer.backends.nvidia.invariant.gemm import linear

    x, w = _rand(1024, k, seed=1), _rand(n, k, seed=2, scale=0.02)
    rows_invariant(lambda a: linear(a, w), x, SIZES, PROBE)
    assert rel_err(linear(x[:129], w), x[:129].float() @ w.float().T) < 1e-2


@pytest.mark.parametrize("bt,n,k", [(1, 3648, 2048), (1, 576, 2048), (1, 2048, 2048), (1, 2048, 10944),
                                     (16, 128, 512), (1, 192, 2048)])
def test_gemm_k_slices_serial_schedule_equals_parallel(bt, n, k):
    """A weight's fixed K split folded by one program (serial) or by the last of its per-slice programs (parallel,
    what small M gets): the same bits, every M; each plan has the slices the op uses."""
    from deepinfer.backends.nvidia.invariant.gemm import Plan, bmm, plan_for

    p = plan_for(bt, n, k, BF16)
    if p.slices(k) == 1:  # a swept one-slice plan (W_UV): the schedules are checked on two slices of its tile
        p = Plan(p.tile, -(-(k // 2) // p.tile.block_k) * p.tile.block_k)
    assert p.slices(k) > 1
    a, b = _rand(bt, 300, k, seed=20), _rand(bt, n, k, seed=21, scale=0.02).transpose(1, 2)
    for m in (1, 7, 64, 300):
        par = bmm(a[:, :m], b, plan=p, parallel=True)
        assert torch.equal(par, bmm(a[:, :m], b, plan=p, parallel=False)), f"M={m}"
        assert torch.equal(par, bmm(a[:, :m], b, plan=p, parallel=True)), "the arrival counters did not reset"


def test_router_and_absorbed_bmm():
    from deepinfer.backends.nvidia.invariant.gemm import bmm, linear

    x, gate = _rand(1024, 2048, seed=3), _rand(64, 2048, seed=4, dtype=torch.float32, scale=0.02)
    rows_invariant(lambda a: linear(a, gate, out_dtype=torch.float32), x, SIZES, PROBE)
    assert rel_err(linear(x, gate, out_dtype=torch.float32), x.double() @ gate.double().T) < 1e-6
    from deepinfer.backends.nvidia.invariant.router import router_linear, split_gate

    parts = split_gate(gate)  # the path InvariantMoE takes for bf16 activations
    rows_invariant(lambda a: router_linear(a, parts), x, SIZES, PROBE)
    # exact products, fp32 accumulation inside the tensor cores: 2.1e-6 measured on the H200 (K = 2048), against
    # 1e-6 for the sequential fp32 FMA path; either is far below the bf16 activations' own rounding
    assert rel_err(router_linear(x, parts), x.double() @ gate.double().T) < 5e-6
    q, w_uk = _rand(1024, 16, 192, seed=5), _rand(16, 128, 512, seed=6, scale=0.05)

    def absorb(a):
        out = torch.empty(a.shape[0], 16, 512, dtype=BF16, device=DEV)
        bmm(a[..., :128].transpose(0, 1), w_uk, out=out.transpose(0, 1))
        return out

    rows_invariant(absorb, q, SIZES, PROBE)
    assert rel_err(absorb(q[:64]), torch.einsum("thn,hnl->thl", q[:64, :, :128].float(), w_uk.float())) < 1e-2


def _moe_spec():
    router = RouterSpec(num_experts=64, top_k=6, topk_method="greedy", scoring_func="softmax", n_group=1,
                        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    return MoESpec(router=router, hidden_size=2048, intermediate_size=1408)


def test_moe_rows_do_not_depend_on_the_batch():
    from deepinfer.backends.nvidia.invariant.moe import InvariantMoE

    spec = _moe_spec()
    w13, w2 = _rand(64, 2816, 2048, seed=7, scale=0.02), _rand(64, 2048, 1408, seed=8, scale=0.02)
    gate = _rand(64, 2048, seed=9, dtype=torch.float32, scale=0.02)
    inv, ref = InvariantMoE(spec), NativeMoE(spec)
    inv.load_experts(w13, w2)
    ref.load_experts(w13, w2)
    x = _rand(1024, 2048, seed=10)
    rows_invariant(lambda a: inv.forward_hidden(a, gate, None, shared_experts=lambda t: t * 0.25), x, SIZES, PROBE)
    assert rel_err(inv.forward_hidden(x[:129], gate), ref.forward_hidden(x[:129], gate)) < 2e-2


def test_moe_with_shared_experts_folded_in_rows_do_not_depend_on_the_batch():
    """The V2-Lite MoE layer as the model runs it: 2 shared experts folded into the grouped GEMMs (experts 64, 65),
    rows independent of the batch, both K-split schedules equal at two 1024-deep slices (the op's own slice,
    moe_gemm.MOE_SLICE_K, leaves V2-Lite's K whole), close to the native MoE plus the dense shared MLP."""
    from deepinfer.backends.nvidia.invariant import moe_gemm
    from deepinfer.backends.nvidia.invariant.moe_align import align

    spec = _moe_spec()
    w13, w2 = _rand(64, 2816, 2048, seed=22, scale=0.02), _rand(64, 2048, 1408, seed=23, scale=0.02)
    gate_up, down = _rand(5632, 2048, seed=24, scale=0.02), _rand(2048, 2816, seed=25, scale=0.02)
    gate = _rand(64, 2048, seed=26, dtype=torch.float32, scale=0.02)

    inv, ref, shared = folded_shared_moe(spec, w13, w2, gate_up, down)
    x = _rand(1024, 2048, seed=27)
    rows_invariant(lambda a: inv.forward_hidden(a, gate, None, shared_experts=shared), x, SIZES, PROBE)
    got = inv.forward_hidden(x[:129], gate, None, shared_experts=shared)
    assert rel_err(got, ref.forward_hidden(x[:129], gate, None, shared_experts=shared)) < 2e-2
    for t in (1, 9, 129):
        weights, ids = inv.route(inv.router_logits(x[:t], gate))
        al = align(ids, 64, 2, 64)
        outs = []
        for parallel in (False, True):
            act = torch.empty((t * 8, 1408), dtype=BF16, device=DEV)
            moe_gemm.aligned_gemm(x[:t], w13, act, al, 64, 6, 8, 8, shared_w=inv.shared_w[0], dual=True,
                                  parallel=parallel, slice_override=1024)
            y = torch.empty((t * 8, 2048), dtype=torch.float32, device=DEV)
            moe_gemm.aligned_gemm(act, w2, y, al, 64, 6, 8, 1, shared_w=inv.shared_w[1], topk_weights=weights,
                                  parallel=parallel, slice_override=1024)
            outs.append((act, y))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), f"T={t}"


SPEC = MLASpec(num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
               softmax_scale=192 ** -0.5)


def _mla(cls, two_stage=None):
    op = cls(SPEC)
    op.load_kv_b_proj(_rand(16 * 256, 512, seed=11, scale=0.05))
    if two_stage is not None:
        op.two_stage = two_stage
    return op


def test_mla_token_bits_independent_of_chunking_decode_schedule_and_batch():
    from deepinfer.backends.nvidia.invariant.mla import InvariantMLAAttention

    op = _mla(InvariantMLAAttention)
    n = 1100  # nine 128-entry splits
    q, kv, pe = seq_inputs(SPEC, n, 0, BF16, DEV)
    cache = lambda: PagedCache(SPEC, 64, 24, 4, BF16, DEV)  # noqa: E731
    whole = cache().run(op, [(0, q, kv, pe)])[0]
    c = cache()
    cuts = (0, 1, 200, 257, 700, 1024, 1100)
    chunked = torch.cat([c.run(op, [(0, q[a:b], kv[a:b], pe[a:b])])[0] for a, b in zip(cuts, cuts[1:])])
    assert torch.equal(chunked, whole)
    for two_stage in (True, False):
        c = cache()
        c.run(op, [(0, q[:1090], kv[:1090], pe[:1090])])
        dec = _mla(InvariantMLAAttention, two_stage)
        steps = torch.cat([c.run(dec, [(0, q[j:j + 1], kv[j:j + 1], pe[j:j + 1])])[0] for j in range(1090, 1100)])
        assert torch.equal(steps, whole[1090:]), f"decode (two_stage={two_stage}) != prefill"
    c = cache()
    a, b = seq_inputs(SPEC, 300, 1, BF16, DEV), seq_inputs(SPEC, 600, 2, BF16, DEV)
    c.run(op, [(1, *a), (2, *(t[:599] for t in b))])
    mixed = c.run(op, [(2, *(t[599:] for t in b)), (0, q, kv, pe), (3, *(t[:5] for t in a))])[1]
    assert torch.equal(mixed, whole)
    ref = cache().run(_mla(NativeMLAAttention), [(0, q.float(), kv.float(), pe.float())])[0]
    assert rel_err(whole, ref) < 2e-2


def test_graph_at_a_padded_bucket_equals_eager():
    """The decode path (GEMM -> MLA decode -> GEMM) captured at bucket 8 with 3 real rows + padding (seq_len 0)
    replays the eager bits of the 3 rows computed alone."""
    from deepinfer.backends.nvidia.invariant.gemm import linear
    from deepinfer.backends.nvidia.invariant.mla import InvariantMLAAttention

    op = _mla(InvariantMLAAttention)
    w = _rand(3072, 2048, seed=12, scale=0.02)
    c = PagedCache(SPEC, 64, 8, 8, BF16, DEV)
    for sid, n in ((0, 300), (1, 40), (2, 511)):
        c.run(op, [(sid, *seq_inputs(SPEC, n, sid, BF16, DEV))])
    batch = c.batch([(0, 1), (1, 1), (2, 1)] + [(s, 0) for s in range(3, 8)])
    batch.query_lens_cpu = [1] * 8  # the graph runner's padded rows: seq_len 0, slot -1
    batch.seq_lens[3:] = 0
    batch.slot_mapping["mla"] = torch.cat([batch.slot_mapping["mla"], torch.full((5,), -1, device=DEV)])
    h = _rand(8, 2048, seed=13)
    kv_c, k_pe = _rand(8, 512, seed=14), _rand(8, 64, seed=15)

    def step():
        q = linear(h, w).view(8, 16, 192)
        return op.forward(q, kv_c, k_pe, c.kv, batch, "mla")

    eager = step()[:3].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:3], eager)


def test_tiles_that_follow_m_pass_their_check_and_keep_rows_invariant():
    """tile_choice.py on the H200: every large GEMM tile of the table, the MoE's BLOCK_M 16 / 128 choices and MLA's
    (BLOCK_Q, warps) and split-schedule warps pass their load-time check (benchmarks/invariant_tile_probe.py found
    them bitwise equal); rows then stay invariant across the sizes where the tile changes (M = LARGE_M, the MoE's 8
    pairs and MOE_LARGE_T; MLA: test_mla_token_bits_independent_of_chunking_decode_schedule_and_batch)."""
    from deepinfer.backends.nvidia.invariant import gemm, tile_choice
    from deepinfer.backends.nvidia.invariant.mla import InvariantMLAAttention
    from deepinfer.backends.nvidia.invariant.moe import InvariantMoE

    tile_choice.reset()
    for (bt, n, k), tile in tile_choice.LARGE_TILES_BF16.items():
        w = _rand(bt, n, k, seed=30, scale=0.02).transpose(1, 2)
        assert tile_choice.check_gemm(w), f"weight [{bt}, {n}, {k}] with {tile}"
        assert gemm.CHECKED_LARGE_TILES[(bt, n, k)] == tile
    w = _rand(3648, 2048, seed=31, scale=0.02)
    x = _rand(1100, 2048, seed=32)
    rows_invariant(lambda a: gemm.linear(a, w), x, (1, 7, 1023, 1024, 1100), PROBE)
    spec = _moe_spec()
    op = InvariantMoE(spec)
    op.load_experts(_rand(64, 2816, 2048, seed=33, scale=0.02), _rand(64, 2048, 1408, seed=34, scale=0.02))
    assert tile_choice.moe_choice(op._tiles_key, 1, 6) == tile_choice.MOE_SMALL, "the MoE check failed"
    gate = _rand(64, 2048, seed=35, dtype=torch.float32, scale=0.02)
    x = _rand(2100, 2048, seed=36)
    rows_invariant(lambda a: op.forward_hidden(a, gate), x, (1, 2, 10, 11, 2047, 2048, 2100), PROBE)
    mla = _mla(InvariantMLAAttention)
    assert tile_choice.mla_tiles(mla._tiles_key) == (tile_choice.MLA_PREFILL, tile_choice.MLA_SPLIT_WARPS), \
        "the MLA check failed"
    tile_choice.reset()
