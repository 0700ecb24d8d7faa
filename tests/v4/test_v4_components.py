"""V4 building blocks against the matching transformers deepseek_v4 modules (fp32).

Sinks with inverse RoPE, grouped output projection, mHC / Sinkhorn, router
scoring vs selection (and hash routing), SwiGLU clamp above the limit,
RoPE / YaRN at positions beyond the original length.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend import MoESpec, RouterSpec, V4AttentionSpec
from deepinfer.backend.forward_batch import ForwardBatch
from deepinfer.backend.kv_caches import KVCaches
from deepinfer.backend.kv_spec import KVCacheSpec
from deepinfer.backend.native.activation import silu_and_mul
from deepinfer.backend.native.v4_attention import NativeV4Attention
from deepinfer.backend.native.v4_rope import apply_v4_rope, v4_cos_sin
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.checkpoints.presets_v4 import tiny_v4_config
from deepinfer.models.deepseek_v4.attention import RopeTable, grouped_linear
from deepinfer.models.deepseek_v4.config import parse_v4_config
from deepinfer.models.deepseek_v4.hyper_connections import HyperConnection, HyperHead, sinkhorn

hf_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def _hf_config(**over):
    from transformers import DeepseekV4Config

    cfg = {k: v for k, v in tiny_v4_config().items() if k not in ("architectures", "compress_ratios")}
    return DeepseekV4Config(**{**cfg, **over})


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _swa_batch(L: int) -> ForwardBatch:
    return ForwardBatch(
        input_ids=torch.zeros(L, dtype=torch.int64), positions=torch.arange(L),
        query_start_loc=torch.tensor([0, L], dtype=torch.int32), seq_lens=torch.tensor([L], dtype=torch.int32),
        context_lens=torch.tensor([0], dtype=torch.int32), block_tables={"swa": torch.zeros((1, 1), dtype=torch.int32)},
        slot_mapping={"swa": torch.full((L,), -1, dtype=torch.int64)}, logits_indices=torch.arange(L),
        query_lens_cpu=[L], seq_lens_cpu=[L], context_lens_cpu=[0],
    )


def _native_swa_attention(q, kv, sinks, window):
    """One request, empty cache: the op masks by cache position (0..L-1); RoPE positions are the caller's."""
    H, D = q.shape[1], q.shape[2]
    op = NativeV4Attention(V4AttentionSpec(num_heads=H, head_dim=D, sliding_window=window, softmax_scale=D**-0.5,
                                           swa_group="swa"))
    op.load_weights({"sinks": sinks})
    spec = KVCacheSpec(name="swa", layer_ids=(0,), entry_shape=(D,), dtype=torch.float32, sliding_window=window)
    caches = KVCaches.allocate([spec], {"swa": 1}, 4, 1, torch.device("cpu"))
    return op.forward(q, kv, caches, 0, _swa_batch(q.shape[0]))


def test_sinks_and_inverse_rope_match_reference():
    cfg = _hf_config()
    L, H, D, W = 21, cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    g = torch.Generator().manual_seed(0)
    q, kv, sinks = torch.randn(L, H, D, generator=g), torch.randn(L, D, generator=g), torch.randn(H, generator=g)
    pos = torch.arange(L) + 5
    rope = RopeTable(parse_v4_config(tiny_v4_config()).rope_main, torch.float32)
    cos, sin = rope(pos)
    q_r, kv_r = apply_v4_rope(q, cos, sin), apply_v4_rope(kv, cos, sin)
    ours = apply_v4_rope(_native_swa_attention(q_r, kv_r, sinks, W), cos, -sin)

    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = H, torch.nn.Parameter(sinks), False
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    mask = torch.zeros(L, L).masked_fill(~((j <= i) & (j > i - W)), float("-inf"))[None, None]
    hq = q_r.transpose(0, 1)[None]
    hk = kv_r[None, None]
    out, _ = hf_v4.eager_attention_forward(module, hq, hk, hk, mask, scaling=D**-0.5)
    ref = hf_v4.apply_rotary_pos_emb(out.transpose(1, 2), cos[None], -sin[None]).transpose(1, 2)[0]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)

    # the inverse rotation leaves only relative positions: shifting every position changes nothing
    cos2, sin2 = rope(pos + 1000)
    shifted = _native_swa_attention(apply_v4_rope(q, cos2, sin2), apply_v4_rope(kv, cos2, sin2), sinks, W)
    torch.testing.assert_close(apply_v4_rope(shifted, cos2, -sin2), ours, atol=1e-4, rtol=1e-4)
    # sinks absorb probability mass: -inf sinks give a plain softmax, a different output
    plain = _native_swa_attention(q_r, kv_r, torch.full((H,), float("-inf")), W)
    assert (plain - _native_swa_attention(q_r, kv_r, sinks, W)).abs().max() > 1e-3


def test_grouped_output_projection_matches_reference():
    G, in_g, out_g, T = 4, 12, 5, 7
    lin = hf_v4.DeepseekV4GroupedLinear(in_g, G * out_g, G)
    _randomize(lin, 1)
    x = torch.randn(T, G, in_g)
    ref = lin(x[None])[0].flatten(1)
    torch.testing.assert_close(grouped_linear(x, lin.weight.detach(), G), ref, atol=1e-6, rtol=1e-6)


def test_hyper_connection_and_sinkhorn_match_reference():
    cfg = _hf_config()
    hc_ref, head_ref = hf_v4.DeepseekV4HyperConnection(cfg), hf_v4.DeepseekV4HyperHead(cfg)
    _randomize(hc_ref, 2)
    _randomize(head_ref, 3)
    n, D = cfg.hc_mult, cfg.hidden_size
    ours = HyperConnection(n, D, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    head = HyperHead(n, D, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(hc_ref.state_dict())
    head.load_state_dict({k: v for k, v in head_ref.state_dict().items()})
    streams = torch.randn(9, n, D)
    post, comb, collapsed = ours(streams)
    r_post, r_comb, r_collapsed = hc_ref(streams[None])
    torch.testing.assert_close(post, r_post[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(comb, r_comb[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(collapsed, r_collapsed[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head(streams), head_ref(streams[None])[0], atol=1e-5, rtol=1e-5)
    # Sinkhorn ends on a column pass; with enough iterations rows converge too (doubly stochastic)
    torch.testing.assert_close(comb.sum(-2), torch.ones(9, n), atol=1e-5, rtol=0)
    x = torch.rand(3, 5, 5) + 0.1
    assert (x.sum(-1) - 1).abs().max() > 0.1
    ds = sinkhorn(x, 200, 0.0)
    torch.testing.assert_close(ds.sum(-1), torch.ones(3, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(ds.sum(-2), torch.ones(3, 5), atol=1e-5, rtol=0)


def test_router_bias_selects_but_does_not_weigh():
    cfg = _hf_config()
    router = hf_v4.DeepseekV4TopKRouter(cfg)
    _randomize(router, 4)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.linspace(-3, 3, E))  # large enough to change choices
    x = torch.randn(32, cfg.hidden_size)
    _, r_w, r_ids = router(x)
    spec = RouterSpec(num_experts=E, top_k=k, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
                      norm_topk_prob=True, routed_scaling_factor=cfg.routed_scaling_factor)
    logits = torch.nn.functional.linear(x, router.weight.detach())
    w, ids = CPUBackend().route(logits, spec, correction_bias=router.e_score_correction_bias)
    order_r, order_o = r_ids.sort(-1), ids.sort(-1)
    assert torch.equal(order_r.values, order_o.values)
    torch.testing.assert_close(w.gather(1, order_o.indices), r_w.gather(1, order_r.indices), atol=1e-6, rtol=1e-5)
    scores = torch.nn.functional.softplus(logits).sqrt()
    assert not torch.equal(scores.topk(k).indices.sort(-1).values, order_o.values)  # the bias changed the choice
    expect = scores.gather(1, ids)
    torch.testing.assert_close(w, expect / expect.sum(-1, keepdim=True) * cfg.routed_scaling_factor)


def test_hash_routing_matches_reference():
    cfg = _hf_config()
    router = hf_v4.DeepseekV4HashRouter(cfg)
    _randomize(router, 5)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.tid2eid.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(1)[:, :2])
    x, tok = torch.randn(16, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (16,))
    _, r_w, r_ids = router(x, tok)
    spec = RouterSpec(num_experts=cfg.n_routed_experts, top_k=2, scoring_func="sqrtsoftplus", topk_method="hash",
                      norm_topk_prob=True, routed_scaling_factor=cfg.routed_scaling_factor)
    w, ids = CPUBackend().route(torch.nn.functional.linear(x, router.weight.detach()), spec, token_ids=tok,
                                tid2eid=router.tid2eid)
    assert torch.equal(ids, r_ids)
    torch.testing.assert_close(w, r_w, atol=1e-6, rtol=1e-5)


def test_swiglu_clamp_above_the_limit_matches_reference():
    cfg = _hf_config()
    experts, mlp = hf_v4.DeepseekV4Experts(cfg), hf_v4.DeepseekV4MLP(cfg)
    _randomize(experts, 6)
    _randomize(mlp, 7)
    x = torch.randn(12, cfg.hidden_size) * 20  # pre-activations far beyond swiglu_limit = 10
    ids = torch.randint(0, cfg.n_routed_experts, (12, 2))
    w = torch.rand(12, 2)
    ref = experts(x, ids, w)
    moe = CPUBackend().make_moe(MoESpec(router=RouterSpec(cfg.n_routed_experts, 2, "sqrtsoftplus", "noaux_tc"),
                                        hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
                                        swiglu_limit=cfg.swiglu_limit))
    from deepinfer.backend.native.moe import experts_forward

    moe.load_experts(experts.gate_up_proj.detach(), experts.down_proj.detach())
    got = experts_forward(x, moe.w13, moe.w2, w, ids, moe.spec.swiglu_limit)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    unclamped = experts_forward(x, moe.w13, moe.w2, w, ids, None)
    assert (unclamped - ref).abs().max() > 1.0  # the clamp was active
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    shared = torch.nn.functional.linear(silu_and_mul(gate_up, cfg.swiglu_limit), mlp.down_proj.weight)
    torch.testing.assert_close(shared, mlp(x), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("branch", ["main", "compress"])
def test_rope_and_yarn_beyond_original_length_match_reference(branch):
    hf_cfg = _hf_config()
    ours = parse_v4_config(tiny_v4_config())
    rope = RopeTable(ours.rope_main if branch == "main" else ours.rope_compress, torch.float32)
    ref = hf_v4.DeepseekV4RotaryEmbedding(hf_cfg)
    pos = torch.cat([torch.arange(0, 70), torch.tensor([255, 1000, 4095])])  # YaRN's original length is 64
    r_cos, r_sin = ref(torch.zeros(1), pos[None], layer_type=branch)
    cos, sin = rope(pos)
    torch.testing.assert_close(cos, r_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, r_sin[0], atol=1e-6, rtol=0)
    if branch == "compress":
        plain = v4_cos_sin(pos, 1.0 / (160000.0 ** (torch.arange(0, 8, 2).float() / 8)))[0]
        assert (plain - cos).abs().max() > 1e-2  # YaRN really rescaled some frequencies
