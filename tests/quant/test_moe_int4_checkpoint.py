"""AWQ / GPTQ routed experts kept int4 end to end: a tiny V3 checkpoint written in the formats' packing (group 64,
experts included) loads with int4 experts on the cpu backend and matches its dequantized twin's logits, GPTQ
act-order (desc_act) checkpoints too (tests/quant/test_int4_experts_act_order.py has the op-level cases); the
contiguous-groups layout alone (int4_expert_rows) refuses an act-order g_idx; a backend whose MoE op lacks the
scheme densifies them as before."""

from __future__ import annotations

import pytest
import torch
from int4_ckpt_util import write_int4_pair
from quant_testutil import prefill_logits

from deepinfer.backend import Int4Weight, int4_expert_rows
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.backends.cpu.ops_moe import CPUMoE
from deepinfer.errors import ModelLoadError
from deepinfer.models.registry import load_model

GROUP = 64  # tiny-v3's moe_intermediate_size is 64: the down projections need groups of 64 to be int4 too


@pytest.fixture(scope="module")
def int4_pairs(tiny_v3_dir, tmp_path_factory) -> dict:
    out = {}
    for method in ("awq", "gptq", "gptq-act-order"):
        root = tmp_path_factory.mktemp(f"moe-int4-{method}")
        dst, twin = str(root / "int4"), str(root / "twin")
        out[method] = (dst, twin, write_int4_pair(tiny_v3_dir, dst, twin, method.split("-")[0], GROUP,
                                                  act_order=method.endswith("act-order")))
    return out


def _moe_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "MoELayer"]


@pytest.mark.parametrize("method", ["awq", "gptq", "gptq-act-order"])
def test_int4_experts_kept_int4_and_match_the_dequantized_twin(method, int4_pairs):
    dst, twin, prefixes = int4_pairs[method]
    assert any(".experts.0.down_proj" in p for p in prefixes), "the writer left the experts dense"
    be = CPUBackend()
    model = load_model(dst, be, torch.float32, progress=False)
    ref = load_model(twin, be, torch.float32, progress=False)
    moes = _moe_layers(model)
    assert moes and all(m.quantized_experts for m in moes)
    for m in moes:
        q = m.op.quant
        assert q.scheme == f"int4_{method.split('-')[0]}" and q.group_size == GROUP and m.op.w13 is None
        assert (q.w13_g_idx is not None) == method.endswith("act-order")
        e, two_i, d = q.w13.shape[0], q.w13.shape[1], q.w13.shape[2] * 2
        assert q.w13.dtype == torch.uint8 and q.w13.numel() == e * two_i * d // 2  # 0.5 byte per weight
    ids = torch.tensor([[3, 17, 42, 5, 99, 7, 250, 11, 64]])
    a, b = prefill_logits(model, be, ids), prefill_logits(ref, be, ids)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert torch.equal(a[-1].argmax(), b[-1].argmax())


class _NoQuantMoE(CPUMoE):
    def quantized_expert_schemes(self) -> tuple[str, ...]:
        return ()


class _DensifyingCPU(CPUBackend):
    def make_moe(self, spec):
        return _NoQuantMoE(spec, route_fn=self.route, silu_and_mul=self.silu_and_mul,
                           dense_max_work=self.moe_dense_max_work)


def test_op_without_the_scheme_densifies(int4_pairs):
    dst, twin, _ = int4_pairs["awq"]
    be = _DensifyingCPU()
    model = load_model(dst, be, torch.float32, progress=False)
    moes = _moe_layers(model)
    assert moes and not any(m.quantized_experts for m in moes) and all(m.op.w13 is not None for m in moes)
    ids = torch.tensor([[3, 17, 42, 5]])
    ref = load_model(twin, CPUBackend(), torch.float32, progress=False)
    torch.testing.assert_close(prefill_logits(model, be, ids), prefill_logits(ref, CPUBackend(), ids),
                               atol=1e-5, rtol=0)


def test_act_order_g_idx_is_refused_trivial_accepted():
    g_idx = (torch.arange(64) // 32).to(torch.int32)
    rec = Int4Weight("gptq", torch.zeros(8, 16, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                     torch.ones(2, 16, dtype=torch.float16), g_idx, 32, 1)
    q, z, s = int4_expert_rows(rec, "e")
    assert tuple(q.shape) == (16, 32) and tuple(z.shape) == (16, 2) and int(z.max()) == 1  # v1: stored 0 -> 1
    rec.g_idx = g_idx.flip(0)
    with pytest.raises(ModelLoadError, match=r"e\.g_idx is not arange\(in_features\) // 32"):
        int4_expert_rows(rec, "e")
