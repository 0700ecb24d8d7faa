"""The fake torch_npu against torch-native code: each emulated operator, with the layout arguments the
backend passes, equals a straightforward computation of its documented semantics; documented limits raise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.backend import NativeOps, RouterSpec
from deepinfer.backend.native.moe import experts_forward

BF = torch.bfloat16


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_norms_and_swiglu(fake_npu):
    g = _g()
    x, r, w = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
    y, rstd = fake_npu.npu_rms_norm(x, w, epsilon=1e-6)
    assert torch.allclose(y, F.rms_norm(x, (64,), w, eps=1e-6), atol=1e-6) and rstd.shape == (5, 1)
    y2, _, s = fake_npu.npu_add_rms_norm(x, r, w, epsilon=1e-6)
    assert torch.equal(s, x + r) and torch.allclose(y2, F.rms_norm(x + r, (64,), w, eps=1e-6), atol=1e-5)
    assert torch.allclose(fake_npu.npu_swiglu(x, dim=-1), F.silu(x[:, :32]) * x[:, 32:])
    with pytest.raises(ValueError):
        fake_npu.npu_swiglu(x[:, :63])


def _rope_tables(t: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(t, 32, generator=g) * 6
    return ang.cos(), ang.sin()


def test_interleave_rope_is_the_interleaved_rotation_de_interleaved(fake_npu):
    g = _g(1)
    x = torch.randn(3, 2, 1, 64, generator=g)
    cos, sin = _rope_tables(3, g)
    full = lambda a: torch.cat([a, a], -1).view(3, 1, 1, 64)
    out = fake_npu.npu_interleave_rope(x.to(BF), full(cos).to(BF), full(sin).to(BF)).float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos.view(3, 1, 1, 32), sin.view(3, 1, 1, 32)
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)  # pairs rotated, then [evens | odds]
    assert torch.allclose(out, ref, atol=3e-2)
    with pytest.raises(TypeError):
        fake_npu.npu_interleave_rope(x, full(cos), full(sin))  # fp32: not a documented dtype


def test_kv_rmsnorm_rope_cache_writes_normed_latent_and_rotated_rope(fake_npu):
    g = _g(2)
    t, nb, bs = 4, 3, 16
    kv = torch.randn(t, 1, 1, 576, generator=g).to(BF)
    gamma = (torch.rand(512, generator=g) + 0.5).to(BF)
    cos, sin = _rope_tables(t, g)
    full = lambda a: torch.cat([a, a], -1).view(t, 1, 1, 64).to(BF)
    k_cache, ckv = torch.zeros(nb, bs, 1, 64, dtype=BF), torch.zeros(nb, bs, 1, 512, dtype=BF)
    slots = torch.tensor([5, 17, 40, 0])
    fake_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, full(cos), full(sin), slots, k_cache, ckv, epsilon=1e-6,
                                       cache_mode="PA")
    lat = F.rms_norm(kv[:, 0, 0, :512].float(), (512,), gamma.float(), eps=1e-6)
    assert torch.allclose(ckv.view(-1, 512)[slots].float(), lat, atol=3e-2)
    rope = fake_npu.npu_interleave_rope(kv[..., 512:].contiguous(), full(cos), full(sin))
    assert torch.equal(k_cache.view(-1, 64)[slots], rope.view(t, 64))
    with pytest.raises(ValueError):
        fake_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, full(cos), full(sin), torch.tensor([1, 1, 2, 3]), k_cache,
                                           ckv, cache_mode="PA")


def test_fia_paged_decode_is_absorbed_attention_over_the_blocks(fake_npu):
    g = _g(3)
    nb, bs, n, seq = 6, 16, 2, [20, 5]
    lat, rope = torch.randn(nb, bs, 512, generator=g).to(BF), torch.randn(nb, bs, 64, generator=g).to(BF)
    q, qr = torch.randn(2, 1, n, 512, generator=g).to(BF), torch.randn(2, 1, n, 64, generator=g).to(BF)
    table = torch.tensor([[4, 1, -1], [2, -1, -1]], dtype=torch.int32)
    out, _ = fake_npu.npu_fused_infer_attention_score(
        q, lat, lat, query_rope=qr, key_rope=rope, num_heads=n, num_key_value_heads=1, input_layout="BSND",
        scale=0.1, block_table=table, block_size=bs, actual_seq_lengths_kv=seq, sparse_mode=0)
    for b, length in enumerate(seq):
        blocks = table[b, : -(-length // bs)].long()
        k = lat[blocks].reshape(-1, 512)[:length].float()
        kr = rope[blocks].reshape(-1, 64)[:length].float()
        p = ((q[b, 0].float() @ k.T + qr[b, 0].float() @ kr.T) * 0.1).softmax(-1)
        assert torch.allclose(out[b, 0].float(), p @ k, atol=2e-2)
    with pytest.raises(ValueError):  # only D = 512 in the absorbed mode
        fake_npu.npu_fused_infer_attention_score(
            q[..., :256].contiguous(), lat[..., :256].contiguous(), lat[..., :256].contiguous(), query_rope=qr,
            key_rope=rope, num_heads=n, num_key_value_heads=1, input_layout="BSND", scale=0.1, block_table=table,
            block_size=bs, actual_seq_lengths_kv=seq)


def test_fia_tnd_prefill_is_bottom_right_causal(fake_npu):
    g = _g(4)
    n, lq, lk = 2, [3, 4], [3, 9]  # request 1: 4 queries on a 5-token cached prefix
    t, s = sum(lq), sum(lk)
    q, k, v = (torch.randn(m, n, 128, generator=g).to(BF) for m in (t, s, s))
    qr, kr = torch.randn(t, n, 64, generator=g).to(BF), torch.randn(s, n, 64, generator=g).to(BF)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    out, _ = fake_npu.npu_fused_infer_attention_score(
        q, k, v, query_rope=qr, key_rope=kr, num_heads=n, num_key_value_heads=n, input_layout="TND", scale=0.08,
        sparse_mode=3, atten_mask=mask, actual_seq_lengths=[3, 7], actual_seq_lengths_kv=[3, 12])
    q0 = k0 = 0
    for a, b in zip(lq, lk):
        qq = torch.cat([q[q0:q0 + a], qr[q0:q0 + a]], -1).float().transpose(0, 1)
        kk = torch.cat([k[k0:k0 + b], kr[k0:k0 + b]], -1).float().transpose(0, 1)
        causal = torch.ones(a, b, dtype=torch.bool).tril(b - a)
        ref = F.scaled_dot_product_attention(qq, kk, v[k0:k0 + b].float().transpose(0, 1), attn_mask=causal,
                                             scale=0.08)
        assert torch.allclose(out[q0:q0 + a].float(), ref.transpose(0, 1), atol=2e-2)
        q0, k0 = q0 + a, k0 + b


@pytest.mark.parametrize("spec", [
    RouterSpec(32, 4, "sigmoid", "noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
    RouterSpec(64, 6, "softmax", "greedy"),
    RouterSpec(16, 4, "softmax", "group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0),
], ids=["v3", "v2-lite", "v2"])
def test_gating_top_k_matches_the_native_router(fake_npu, spec):
    g = _g(5)
    logits, bias = torch.randn(9, spec.num_experts, generator=g) * 2, torch.randn(spec.num_experts, generator=g) * .1
    grouped = spec.n_group > 1
    y, idx, _ = fake_npu.npu_moe_gating_top_k(
        logits, spec.top_k, bias=bias if spec.topk_method == "noaux_tc" else None,
        k_group=spec.topk_group if grouped else 1, group_count=spec.n_group if grouped else 1,
        group_select_mode=1 if spec.topk_method == "noaux_tc" else 0, norm_type=int(spec.scoring_func == "sigmoid"),
        routed_scaling_factor=spec.routed_scaling_factor)
    w, ids = NativeOps().route(logits, spec, bias if spec.topk_method == "noaux_tc" else None)
    assert torch.equal(idx.long(), ids) and torch.allclose(y, w, atol=1e-6)
    with pytest.raises(ValueError):  # groups of 2 experts: the op needs more than 2
        fake_npu.npu_moe_gating_top_k(logits[:, :16], 2, k_group=2, group_count=8)


def test_routing_grouped_matmul_finalize_equal_the_native_experts(fake_npu):
    g = _g(6)
    t, d, inter, e, k = 7, 32, 16, 8, 3
    x = torch.randn(t, d, generator=g)
    w13, w2 = torch.randn(e, 2 * inter, d, generator=g) * .2, torch.randn(e, d, inter, generator=g) * .2
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    ex, row_idx, counts, _ = fake_npu.npu_moe_init_routing_v2(
        x, ids.int(), expert_num=e, expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1,
        active_expert_range=[0, e])
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=e))
    assert torch.equal(ex[row_idx.long()], x.repeat_interleave(k, 0))  # gather index: (t, k) -> its row
    h = fake_npu.npu_grouped_matmul([ex], [w13.transpose(1, 2).contiguous()], group_list=counts, group_type=0,
                                    group_list_type=1, split_item=2)[0]
    h2 = fake_npu.npu_grouped_matmul([ex], [w13.transpose(1, 2).contiguous()], group_list=counts.cumsum(0),
                                     group_type=0, group_list_type=0, split_item=2)[0]
    assert torch.equal(h, h2)
    a = fake_npu.npu_swiglu(h)
    y = fake_npu.npu_grouped_matmul([a], [w2.transpose(1, 2).contiguous()], group_list=counts, group_type=0,
                                    group_list_type=1, split_item=2)[0]
    out = fake_npu.npu_moe_finalize_routing(y, None, None, None, weights, row_idx, ids.int(), drop_pad_mode=2)
    assert torch.allclose(out, experts_forward(x, w13, w2, weights, ids), atol=1e-5)
    col = row_idx.view(t, k).T.reshape(-1).contiguous()  # the same map in column order (drop_pad_mode 0)
    assert torch.allclose(fake_npu.npu_moe_finalize_routing(y, None, None, None, weights, col, ids.int()), out)
