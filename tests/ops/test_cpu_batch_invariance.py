"""The cpu backend's batch-invariant ops (deepinfer/backends/cpu/invariant.py): bitwise per row.

Each op's row i computed alone equals row i inside batches of M in {1, 2, 3, 7, 64, 127, 128, 129, 1024};
MLA gives the same bits for a token whether it comes in a prefill, in chunks, one at a time, or beside other
sequences; every op stays within fp32 rounding of the native oracle. One intra-op thread, as the backend runs
them (invariant.py says why)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.backend import ForwardBatch, MLASpec, MoESpec, RouterSpec
from deepinfer.backend.native.mla_attention import NativeMLAAttention
from deepinfer.backend.native.moe import NativeMoE
from deepinfer.backend.native.norm import add_rms_norm, rms_norm
from deepinfer.backend.native.routing import route
from deepinfer.backends.cpu.invariant import (
    InvariantMLAAttention,
    InvariantMoE,
    row_chunked_mm,
    score,
    silu_and_mul,
)

SIZES = [1, 2, 3, 7, 64, 127, 128, 129, 1024]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows_invariant(fn, x: torch.Tensor, probe=(0, 1, 2, 6)) -> None:
    """fn over x[:M] for every M: the probed rows are the same bits as fn over each row alone."""
    alone = {i: fn(x[i: i + 1].clone()) for i in probe}
    for m in SIZES:
        out = fn(x[:m].clone())
        for i in probe:
            if i < m:
                assert torch.equal(out[i: i + 1], alone[i]), (m, i)


def test_row_chunked_mm_rows_do_not_depend_on_m():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1024, 96, generator=g), torch.randn(96, 80, generator=g)
    _rows_invariant(lambda a: row_chunked_mm(a, w), x)
    torch.testing.assert_close(row_chunked_mm(x, w), x @ w, rtol=1e-5, atol=1e-5)
    _rows_invariant(lambda a: row_chunked_mm(a, w.t().contiguous().t()), x)  # a transposed weight view too


@pytest.mark.parametrize("width", [24, 64, 100])
def test_elementwise_and_row_ops(width):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 2 * width, generator=g) * 3
    w = torch.rand(2 * width, generator=g) + 0.5
    _rows_invariant(silu_and_mul, x)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :width]) * x[:, width:])
    _rows_invariant(lambda a: score(a, "sigmoid"), x)
    _rows_invariant(lambda a: score(a, "softmax"), x)
    _rows_invariant(lambda a: rms_norm(a, w, 1e-6), x)
    _rows_invariant(lambda a: add_rms_norm(a, a * 0.5, w, 1e-6)[0], x)


def _moe_spec(experts: int, method: str) -> MoESpec:
    groups = 4 if method == "noaux_tc" else 1
    router = RouterSpec(num_experts=experts, top_k=4, topk_method=method,
                        scoring_func="sigmoid" if method == "noaux_tc" else "softmax", n_group=groups,
                        topk_group=2 if groups > 1 else 1, norm_topk_prob=method == "noaux_tc",
                        routed_scaling_factor=2.5 if method == "noaux_tc" else 1.0)
    return MoESpec(router=router, hidden_size=64, intermediate_size=48)


@pytest.mark.parametrize("experts,method", [(16, "noaux_tc"), (8, "greedy")])
def test_moe_rows_do_not_depend_on_the_batch(experts, method):
    g = torch.Generator().manual_seed(2)
    spec = _moe_spec(experts, method)
    w13, w2 = torch.randn(experts, 96, 64, generator=g) * 0.1, torch.randn(experts, 64, 48, generator=g) * 0.1
    gate, bias = torch.randn(experts, 64, generator=g), torch.randn(experts, generator=g) * 0.1
    inv, ref = InvariantMoE(spec), NativeMoE(spec)
    inv.load_experts(w13, w2)
    ref.load_experts(w13, w2)
    cb = bias if method == "noaux_tc" else None
    x = torch.randn(1024, 64, generator=g)
    _rows_invariant(lambda a: inv.forward_hidden(a, gate, cb, shared_experts=lambda t: t * 0.25), x)
    torch.testing.assert_close(inv.forward_hidden(x[:129], gate, cb), ref.forward_hidden(x[:129], gate, cb),
                               rtol=1e-4, atol=1e-5)
    # the invariant scores select what the reference selects
    logits = inv.router_logits(x, gate)
    assert torch.equal(route(logits, spec.router, cb, score_fn=score)[1], route(logits, spec.router, cb)[1])


# ------------------------------------------------------------------ MLA

SPEC = MLASpec(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
               softmax_scale=0.17)
BLOCK = 16


class Cache:
    """A paged latent cache with hand-made block tables: sequence s owns blocks s*10 .. s*10+9."""

    def __init__(self):
        self.kv = torch.zeros(64, BLOCK, SPEC.kv_lora_rank + SPEC.qk_rope_head_dim)
        self.lens: dict[int, int] = {}

    def run(self, op, chunks: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """chunks: (seq, q [n, H, nope+rope], kv_c [n, L], k_pe [n, R]) -> each chunk's output rows."""
        qs, kvs, pes, slots, qlens, ctxs = [], [], [], [], [], []
        for sid, q, kv_c, k_pe in chunks:
            ctx = self.lens.get(sid, 0)
            n = q.shape[0]
            slots += [(sid * 10 + (ctx + j) // BLOCK) * BLOCK + (ctx + j) % BLOCK for j in range(n)]
            qs.append(q), kvs.append(kv_c), pes.append(k_pe), qlens.append(n), ctxs.append(ctx)
            self.lens[sid] = ctx + n
        table = torch.tensor([[sid * 10 + b for b in range(10)] for sid, *_ in chunks], dtype=torch.int32)
        seq = [c + n for c, n in zip(ctxs, qlens)]
        batch = ForwardBatch(
            input_ids=torch.zeros(sum(qlens), dtype=torch.int64), positions=torch.zeros(sum(qlens), dtype=torch.int64),
            query_start_loc=torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32),
            seq_lens=torch.tensor(seq, dtype=torch.int32), context_lens=torch.tensor(ctxs, dtype=torch.int32),
            block_tables={"mla": table}, slot_mapping={"mla": torch.tensor(slots, dtype=torch.int64)},
            logits_indices=torch.arange(sum(qlens)), query_lens_cpu=qlens, seq_lens_cpu=seq, context_lens_cpu=ctxs,
            block_size=BLOCK,
        )
        out = op.forward(torch.cat(qs), torch.cat(kvs), torch.cat(pes), self.kv, batch, "mla")
        return list(out.split(qlens))


def _seq(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    H, nope, rope, L = SPEC.num_heads, SPEC.qk_nope_head_dim, SPEC.qk_rope_head_dim, SPEC.kv_lora_rank
    return torch.randn(n, H, nope + rope, generator=g), torch.randn(n, L, generator=g), torch.randn(n, rope, generator=g)


@pytest.fixture(scope="module")
def kv_b():
    g = torch.Generator().manual_seed(9)
    return torch.randn(SPEC.num_heads * (SPEC.qk_nope_head_dim + SPEC.v_head_dim), SPEC.kv_lora_rank, generator=g) * 0.2


def _op(cls, kv_b):
    op = cls(SPEC)
    op.load_kv_b_proj(kv_b)
    return op


def test_mla_token_bits_independent_of_prefill_chunking_decode_and_batch(kv_b):
    op = _op(InvariantMLAAttention, kv_b)
    q, kv_c, k_pe = _seq(100, 0)  # 100 tokens: two context blocks of 64, a partial one
    whole = Cache().run(op, [(0, q, kv_c, k_pe)])[0]
    c = Cache()
    chunked = torch.cat([c.run(op, [(0, q[a:b], kv_c[a:b], k_pe[a:b])])[0]
                         for a, b in ((0, 1), (1, 37), (37, 64), (64, 65), (65, 100))])
    c = Cache()
    one_by_one = torch.cat([c.run(op, [(0, q[j:j + 1], kv_c[j:j + 1], k_pe[j:j + 1])])[0] for j in range(100)])
    assert torch.equal(chunked, whole) and torch.equal(one_by_one, whole)
    # beside other sequences (prefills and decodes of other lengths), in any order
    c = Cache()
    others = [_seq(n, 10 + n) for n in (5, 70, 129)]
    c.run(op, [(1, *others[0]), (2, *others[1])])
    mixed = c.run(op, [(3, *others[2]), (0, q, kv_c, k_pe), (1, *(t[:1] for t in _seq(1, 3)))])[1]
    assert torch.equal(mixed, whole)
    ref = Cache().run(_op(NativeMLAAttention, kv_b), [(0, q, kv_c, k_pe)])[0]
    torch.testing.assert_close(whole, ref, rtol=1e-4, atol=1e-5)
