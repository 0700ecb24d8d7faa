"""Quantized routed experts (fp8 block, V4's fp4) in the MoE op contract: the format, the native / cpu ops vs
densify-then-compute, memory kept quantized, and end to end on tiny checkpoints (fp8 V3, fp4 V4)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from moe_quant_util import D, E, make_experts, routing
from quant_testutil import prefill_logits

from deepinfer.backend import BackendError, MoESpec, NativeMoE, RouterSpec, dequant_fp4, quantize_fp4
from deepinfer.backend.native.moe import experts_forward
from deepinfer.backend.native.quant_fp4 import E2M1_VALUES, unpack_fp4
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.backends.cpu.ops_moe import CPUMoE
from deepinfer.models.registry import load_model

ROUTER = RouterSpec(num_experts=E, top_k=2, scoring_func="softmax", topk_method="greedy")
# fp8: I not a multiple of 128 (separate gate / up scale grids); int4: groups of 32 (AWQ) and 64 (GPTQ)
CASES = [("fp8_block", 48), ("fp4", 32), ("int4_awq", 32), ("int4_gptq", 64)]


def test_fp4_nibble_order_and_values():
    # byte 0x3A: low nibble 0xA = -1.0 (column 0), high nibble 0x3 = 1.5 (column 1)
    assert unpack_fp4(torch.tensor([[0x3A]], dtype=torch.uint8)).tolist() == [[-1.0, 1.5]]
    assert unpack_fp4(torch.arange(16, dtype=torch.uint8).view(1, 16) * 17).view(16, 2)[:, 0].tolist() == \
        list(E2M1_VALUES)
    # exact e2m1 values times a power of two survive the round trip (ue8m0 scale)
    w = torch.tensor(E2M1_VALUES * 4).view(2, 32) * 0.25
    packed, scale = quantize_fp4(w)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (2, 16) and scale.dtype == torch.uint8
    assert torch.equal(dequant_fp4(packed, scale), w)


@pytest.mark.parametrize("dtype", [d for d in (getattr(torch, "float8_e4m3fn", None),
                                               getattr(torch, "float8_e4m3fnuz", None)) if d is not None])
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 5)])
def test_fp8_dequant_equals_the_elementwise_definition(dtype, shape):
    """dequant_fp8_block on the CPU (a table of the format's 256 values, scales broadcast over whole blocks) gives
    the bits of torch's element-wise conversion times the expanded scale grid, for every byte code (NaN codes NaN),
    whole and partial 128-blocks."""
    from deepinfer.backend.native.linear import dequant_fp8_block, fp8_values

    g = torch.Generator().manual_seed(shape[0])
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes.view(-1)[: min(256, codes.numel())] = torch.arange(min(256, codes.numel()), dtype=torch.uint8)
    w = codes.view(dtype)
    scale = torch.rand((-(-shape[0] // 128), -(-shape[1] // 128)), generator=g) + 0.01
    want = w.float() * scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    got = dequant_fp8_block(w, scale)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(fp8_values(w).nan_to_num(7.0), w.float().nan_to_num(7.0))


@pytest.mark.parametrize("rows,k,group", [(256, 256, 128), (48, 128, 32), (64, 192, 64)])
def test_int4_rows_dequant_equals_the_elementwise_definition(rows, k, group):
    """dequant_int4_rows (zero and scale broadcast over whole groups) gives the bits of (q - zero) * scale with
    both expanded to every input channel, low nibble first."""
    from deepinfer.backend.native.quant_int4 import dequant_int4_rows

    g = torch.Generator().manual_seed(rows + k)
    packed = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (rows, k // group), generator=g, dtype=torch.uint8)
    scales = (torch.rand(rows, k // group, generator=g) * 0.01).half()
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(rows, k).float()
    want = (q - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
    assert torch.equal(dequant_int4_rows(packed, zeros, scales, group), want)


@pytest.mark.parametrize("scheme,inter", CASES)
@pytest.mark.parametrize("make", ["native", "cpu"])
def test_quantized_op_matches_dense_twin(scheme, inter, make):
    q, w13, w2 = make_experts(scheme, inter)
    spec = MoESpec(router=ROUTER, hidden_size=D, intermediate_size=inter)
    op = NativeMoE(spec) if make == "native" else CPUBackend().make_moe(spec)
    assert scheme in op.quantized_expert_schemes()
    op.load_quantized_experts(q)
    # memory: the op holds the stored bytes only (1 byte / 0.5 byte per weight + scales), no dense copy
    per_weight = 1.0 if scheme == "fp8_block" else 0.5  # int4: two 4-bit values per byte, as fp4
    assert q.w13.element_size() == 1 and q.w13.numel() == E * 2 * inter * D * per_weight
    assert op.w13 is None and getattr(op, "w13_all", None) is None
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(5))
    for t, drop in ((7, False), (5, True), (1, False), (0, False)):  # ragged, -1 ids, one pair path, empty
        wts, ids = routing(t, drop=drop)
        ref = experts_forward(x[:t], w13, w2, wts, ids)
        torch.testing.assert_close(op.experts(x[:t], wts, ids), ref, atol=1e-6, rtol=1e-6)
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(6))
    ref = experts_forward(x[:6], w13, w2, *op.route(logits))
    torch.testing.assert_close(op.forward(x[:6], logits), ref, atol=1e-6, rtol=1e-6)


def test_local_slot_subset_and_errors():
    q, w13, w2 = make_experts("fp4", 32)
    spec = MoESpec(router=ROUTER, hidden_size=D, intermediate_size=32, num_local_experts=2)
    op = NativeMoE(spec)
    with pytest.raises(BackendError, match=r"w13 has shape \(4, 64, 32\), expected \(2, 64, 32\)"):
        op.load_quantized_experts(q)
    sub = type(q)(q.scheme, q.w13[2:], q.w13_scale[2:], q.w2[2:], q.w2_scale[2:])  # this rank's slots 2, 3
    op.load_quantized_experts(sub)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(2))
    wts, ids = routing(6, drop=True)
    local = torch.where(ids >= 2, ids - 2, -1)
    torch.testing.assert_close(op.experts(x, wts, local), experts_forward(x, w13[2:], w2[2:], wts, local))
    with pytest.raises(BackendError, match="moving quantized experts"):
        op.replace_experts(w13[2:], w2[2:])


class _NoQuantMoE(CPUMoE):
    """The cpu MoE op without quantized experts: the model densifies them (what every op did before)."""

    def quantized_expert_schemes(self) -> tuple[str, ...]:
        return ()


class _DensifyingCPU(CPUBackend):
    def make_moe(self, spec):
        return _NoQuantMoE(spec, route_fn=self.route, silu_and_mul=self.silu_and_mul,
                           dense_max_work=self.moe_dense_max_work)


@pytest.fixture(scope="module")
def v3_fp8_dir(tmp_path_factory) -> str:
    from deepinfer.checkpoints import make_checkpoint

    out = str(tmp_path_factory.mktemp("tiny-v3-fp8"))
    make_checkpoint("tiny-v3-fp8", out, seed=3)
    return out


def _greedy(model, backend, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = prefill_logits(model, backend, torch.tensor([ids]))
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


def test_tiny_v3_fp8_experts_kept_fp8_same_greedy_tokens(v3_fp8_dir):
    be, dense_be = CPUBackend(), _DensifyingCPU()
    kept = load_model(v3_fp8_dir, be, torch.float32, progress=False)
    dense = load_model(v3_fp8_dir, dense_be, torch.float32, progress=False)
    moe_k = [m for m in kept.modules() if type(m).__name__ == "MoELayer"]
    moe_d = [m for m in dense.modules() if type(m).__name__ == "MoELayer"]
    assert moe_k and all(m.quantized_experts for m in moe_k) and not any(m.quantized_experts for m in moe_d)
    for mk, md in zip(moe_k, moe_d):
        q = mk.op.quant
        assert q.w13.dtype == torch.float8_e4m3fn and q.w2.dtype == torch.float8_e4m3fn
        dense_bytes = md.op.w13.numel() * md.op.w13.element_size() + md.op.w2.numel() * md.op.w2.element_size()
        weights_bytes = q.w13.numel() + q.w2.numel()
        assert weights_bytes * 4 == dense_bytes  # 1 byte per weight vs fp32
    prompt = torch.randint(2, 500, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    lk = prefill_logits(kept, be, torch.tensor([prompt]))
    ld = prefill_logits(dense, dense_be, torch.tensor([prompt]))
    torch.testing.assert_close(lk, ld, atol=1e-5, rtol=0)
    assert _greedy(kept, be, prompt, 4) == _greedy(dense, dense_be, prompt, 4)


def test_tiny_v4_fp4_checkpoint_matches_dequantized_twin(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "v4"))
    from v4_helpers import load_ours, run_chunks

    from deepinfer.checkpoints.fp4_writer import write_fp4_checkpoint, write_fp4_twin
    from deepinfer.checkpoints.presets_v4 import tiny_v4_config, v4_tensor_plan
    from deepinfer.checkpoints.random_weights import write_safetensors

    src, fp4, twin = tmp_path / "src", tmp_path / "fp4", tmp_path / "twin"
    # as V4 releases ship: fp8 128x128 linears; the writer then stores the routed experts fp4
    cfg = {**tiny_v4_config(), "torch_dtype": "float32",
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    write_safetensors(str(src), v4_tensor_plan(cfg, True), 1, torch.float32)
    assert len(write_fp4_checkpoint(str(src), str(fp4))) == len(write_fp4_twin(str(src), str(twin))) > 0
    ours, ref = load_ours(str(fp4)), load_ours(str(twin))
    moes = [m for m in ours.modules() if type(m).__name__ == "V4MoE"]
    assert moes and all(m.quantized_experts and m.op.quant.scheme == "fp4" for m in moes)
    q = moes[0].op.quant
    assert q.w13.dtype == torch.uint8 and q.w13.shape[-1] == moes[0].D // 2 and q.w13_scale.dtype == torch.uint8
    ids = torch.randint(2, 1024, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(run_chunks(ours, ids, [13]), run_chunks(ref, ids, [13]), atol=1e-5, rtol=0)
