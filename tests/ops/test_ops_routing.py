"""Routers and routed experts against Hugging Face's DeepSeek V2 / V3 / V4 modules, fed the same weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DeepseekV2Config, DeepseekV3Config, DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf3  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf4  # noqa: E402

from deepinfer.backend import MoESpec, RouterSpec  # noqa: E402
from deepinfer.backend.native import NativeOps  # noqa: E402
from deepinfer.backend.native.routing import route  # noqa: E402
from deepinfer.errors import BackendError  # noqa: E402

D, E, I, T = 32, 16, 8, 11
OPS = NativeOps()


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _assert_same_routing(ours, theirs):
    w, i = _sorted(*ours)
    hw, hi = _sorted(theirs[0].float(), theirs[1].long())
    assert torch.equal(i, hi)
    torch.testing.assert_close(w, hw, rtol=1e-6, atol=1e-7)


def _fill(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _v2(method: str, **kw) -> DeepseekV2Config:
    return DeepseekV2Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=4, moe_intermediate_size=I,
                            n_shared_experts=1, topk_method=method, n_group=4, topk_group=2,
                            routed_scaling_factor=1.7, norm_topk_prob=False, **kw)


def _v2_spec(cfg, method: str) -> RouterSpec:
    return RouterSpec(num_experts=E, top_k=4, scoring_func="softmax", topk_method=method, n_group=cfg.n_group,
                      topk_group=cfg.topk_group, norm_topk_prob=False, routed_scaling_factor=cfg.routed_scaling_factor)


def _v3(norm: bool = True) -> DeepseekV3Config:
    return DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=4, moe_intermediate_size=I,
                            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            norm_topk_prob=norm)


def _v3_spec(cfg) -> RouterSpec:
    return RouterSpec(num_experts=E, top_k=4, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
                      topk_group=2, norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=2.5)


def _v4() -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=4, moe_intermediate_size=I,
                            vocab_size=50, num_hidden_layers=4, routed_scaling_factor=1.5, swiglu_limit=0.7)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_router(method):
    cfg = _v2(method)
    gate = hf2.DeepseekV2TopkRouter(cfg)
    _fill(gate, 1)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    logits, hw, hi = gate(x)
    _assert_same_routing(route(logits, _v2_spec(cfg, method)), (hw, hi))
    if method == "group_limited_greedy":  # the group limit must matter on these inputs
        greedy = route(logits, _v2_spec(cfg, "greedy"))
        assert not torch.equal(_sorted(*greedy)[1], _sorted(hw, hi)[1])


@pytest.mark.parametrize("norm", [True, False])
def test_v3_router_noaux_tc_with_bias(norm):
    cfg = _v3(norm)
    gate = hf3.DeepseekV3TopkRouter(cfg)
    _fill(gate, 3)
    # a large bias on a few experts changes selection but must not enter the weights
    bias = torch.zeros(E)
    bias[[1, 6, 13]] = 0.8
    gate.e_score_correction_bias.copy_(bias)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(4))
    logits, hw, hi = gate(x)
    ours = route(logits, _v3_spec(cfg), correction_bias=bias)
    _assert_same_routing(ours, (hw, hi))
    no_bias = route(logits, _v3_spec(cfg), correction_bias=torch.zeros(E))
    assert not torch.equal(_sorted(*ours)[1], _sorted(*no_bias)[1])


def test_v3_unselected_groups_masked_with_minus_inf():
    """All-negative corrected scores: masking with 0 would let unselected groups win; -inf must not."""
    spec = RouterSpec(num_experts=8, top_k=2, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
                      topk_group=1, norm_topk_prob=True)
    logits = torch.tensor([[0.0, 0.1, 5.0, 4.0, 0.2, 0.3, -1.0, -2.0]])
    _, ids = route(logits, spec, correction_bias=torch.full((8,), -10.0))
    assert sorted(ids[0].tolist()) == [2, 3]


def test_v4_topk_router_sqrtsoftplus():
    cfg = _v4()
    gate = hf4.DeepseekV4TopKRouter(cfg)
    _fill(gate, 5)
    bias = torch.linspace(-0.3, 0.3, E)
    gate.e_score_correction_bias.copy_(bias)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(6))
    logits, hw, hi = gate(x)
    spec = RouterSpec(num_experts=E, top_k=4, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
                      norm_topk_prob=True, routed_scaling_factor=1.5)
    _assert_same_routing(route(logits, spec, correction_bias=bias), (hw, hi))


def test_v4_hash_router():
    cfg = _v4()
    gate = hf4.DeepseekV4HashRouter(cfg)
    _fill(gate, 7)
    g = torch.Generator().manual_seed(8)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(50)])
    gate.tid2eid.copy_(tid2eid)
    x = torch.randn(T, D, generator=g)
    token_ids = torch.randint(0, 50, (T,), generator=g)
    logits, hw, hi = gate(x, token_ids)
    spec = RouterSpec(num_experts=E, top_k=4, scoring_func="sqrtsoftplus", topk_method="hash",
                      norm_topk_prob=True, routed_scaling_factor=1.5)
    w, i = route(logits, spec, token_ids=token_ids, tid2eid=tid2eid)
    assert torch.equal(i, tid2eid[token_ids])
    _assert_same_routing((w, i), (hw, hi))


def test_ties_go_to_lowest_index():
    spec = RouterSpec(num_experts=6, top_k=2, scoring_func="softmax", topk_method="greedy")
    _, ids = route(torch.zeros(3, 6), spec)
    assert ids.tolist() == [[0, 1]] * 3


def test_group_ties_go_to_lowest_group():
    spec = RouterSpec(num_experts=8, top_k=2, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
                      topk_group=1)
    _, ids = route(torch.zeros(2, 8), spec, correction_bias=torch.zeros(8))
    assert ids.tolist() == [[0, 1]] * 2


def test_router_errors_name_the_problem():
    with pytest.raises(BackendError, match="scoring_func"):
        route(torch.zeros(1, 4), RouterSpec(num_experts=4, top_k=1, scoring_func="relu", topk_method="greedy"))
    with pytest.raises(BackendError, match="e_score_correction_bias"):
        route(torch.zeros(1, 4), RouterSpec(num_experts=4, top_k=1, scoring_func="sigmoid", topk_method="noaux_tc"))
    with pytest.raises(BackendError, match="tid2eid"):
        route(torch.zeros(1, 4), RouterSpec(num_experts=4, top_k=1, scoring_func="softmax", topk_method="hash"))


# ------------------------------------------------------------------ whole routed-experts block


def _moe_from_hf(experts: torch.nn.Module, spec: MoESpec):
    op = OPS.make_moe(spec)
    op.load_experts(experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone())
    return op


def test_v2_moe_block():
    cfg = _v2("group_limited_greedy")
    block = hf2.DeepseekV2Moe(cfg)
    _fill(block, 9)
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(10))
    ref = block(x)[0] - block.shared_experts(x)[0]
    logits = block.gate(x)[0]
    op = _moe_from_hf(block.experts, MoESpec(router=_v2_spec(cfg, "group_limited_greedy"), hidden_size=D,
                                             intermediate_size=I))
    torch.testing.assert_close(op.forward(x[0], logits), ref, rtol=1e-5, atol=1e-5)


def test_v3_moe_block():
    cfg = _v3()
    block = hf3.DeepseekV3MoE(cfg)
    _fill(block, 11)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(12)) * 0.2
    block.gate.e_score_correction_bias.copy_(bias)
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(13))
    ref = block(x)[0] - block.shared_experts(x)[0]
    logits = block.gate(x)[0]
    op = _moe_from_hf(block.experts, MoESpec(router=_v3_spec(cfg), hidden_size=D, intermediate_size=I))
    torch.testing.assert_close(op.forward(x[0], logits, correction_bias=bias), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [0, 3])  # layer 0 is hash_moe, layer 3 a learned router
def test_v4_moe_block_with_swiglu_limit(layer):
    cfg = _v4()
    block = hf4.DeepseekV4SparseMoeBlock(cfg, layer)
    _fill(block, 14)
    g = torch.Generator().manual_seed(15)
    x = torch.randn(1, T, D, generator=g) * 2  # large enough for the 0.7 clamp to bite
    token_ids = torch.randint(0, 50, (1, T), generator=g)
    tid2eid = None
    if block.is_hash:
        tid2eid = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(50)])
        block.gate.tid2eid.copy_(tid2eid)
        logits = block.gate(x, token_ids)[0]
        method = "hash"
    else:
        block.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
        logits = block.gate(x)[0]
        method = "noaux_tc"
    ref = block(x, token_ids)[0] - block.shared_experts(x)[0]
    spec = MoESpec(
        router=RouterSpec(num_experts=E, top_k=4, scoring_func="sqrtsoftplus", topk_method=method,
                          norm_topk_prob=True, routed_scaling_factor=1.5),
        hidden_size=D, intermediate_size=I, swiglu_limit=0.7,
    )
    op = _moe_from_hf(block.experts, spec)
    bias = None if block.is_hash else block.gate.e_score_correction_bias
    out = op.forward(x[0], logits, correction_bias=bias, token_ids=token_ids[0], tid2eid=tid2eid)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
