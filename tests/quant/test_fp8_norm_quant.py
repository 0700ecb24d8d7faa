"""The RMSNorm that writes its output's fp8 quantization for W8A8 consumers (backend/fp8_act.py, nvidia
quant/rmsnorm_fp8.py): the kernel against the torch reference (the norm op, then quantize_act_fp8), and a whole
W8A8 model whose logits are the same bits with the fused path on and off while it runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from quant_testutil import prefill_logits

from deepinfer.backend import ROW_ALIGN, fp8_act_reference, padded_rows
from deepinfer.backend.native.quant_fp8 import AMAX_FLOOR, FP8_MAX, quantize_act_fp8
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.errors import BackendError
from deepinfer.models.layers.quant import LinearQuantSettings, use_linear_quant
from deepinfer.models.registry import load_model


@pytest.fixture
def nv(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from deepinfer.backends.nvidia.backend import NvidiaBackend

    return NvidiaBackend(device="cpu")


def _check_act(act, x_ref: torch.Tensor) -> None:
    """act's x is x_ref bit for bit, q / s its reference quantization, the padding rows zeros with the floor
    scale, s_cm the same values column-major."""
    t, d = x_ref.shape
    tp = padded_rows(t)
    assert act.q.shape == (tp, d) and tp % ROW_ALIGN == 0 and act.s.shape == act.s_cm.shape == (tp, -(-d // 128))
    assert act.s_cm.stride() == (1, tp) and act.s.stride() == (act.s.shape[1], 1)
    torch.testing.assert_close(act.x, x_ref, atol=0, rtol=0)
    q, s = quantize_act_fp8(x_ref)
    torch.testing.assert_close(act.q[:t].float(), q.float(), atol=0, rtol=0)
    torch.testing.assert_close(act.s[:t], s, atol=0, rtol=0)
    torch.testing.assert_close(act.s_cm, act.s, atol=0, rtol=0)
    assert not act.q[t:].float().any()
    assert torch.all(act.s[t:] == torch.tensor(AMAX_FLOOR, dtype=torch.float32) / FP8_MAX)


@pytest.mark.parametrize("t, d, dtype", [(1, 128, torch.float32), (5, 200, torch.bfloat16),
                                         (17, 256, torch.float32)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_kernel_matches_the_reference(nv, t, d, dtype, with_residual):
    """The kernel's sum and normed row are the plain norm kernel's, its e4m3 values and scales the reference's
    quantization of that row (a partial last group at D 200; 17 rows pad to 32); the default (reference) op of the
    contract gives the same."""
    g = torch.Generator().manual_seed(t * d)
    x = (torch.randn(t, d, generator=g) * 3).to(dtype)
    x[0, :64] *= 40  # one group far larger than the rest: the groups' scales differ
    res = torch.randn(t, d, generator=g).to(dtype) if with_residual else None
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    act, total = nv.rms_norm_fp8(x, res, w, 1e-6)
    if with_residual:
        ref_out, ref_total = nv.add_rms_norm(x, res, w, 1e-6)
        torch.testing.assert_close(total, ref_total, atol=0, rtol=0)
    else:
        ref_out = nv.rms_norm(x, w, 1e-6)
        assert total is None
    _check_act(act, ref_out)
    cpu_act, _ = CPUBackend().rms_norm_fp8(x, res, w, 1e-6)  # the contract's default: norm, then the reference
    _check_act(cpu_act, cpu_act.x)
    bf16 = dtype == torch.bfloat16  # the torch and Triton norms round the last bit differently at times
    torch.testing.assert_close(cpu_act.x.float(), ref_out.float(), atol=0 if bf16 else 1e-5, rtol=2e-2 if bf16 else 0)


@pytest.mark.parametrize("t, inter, dtype", [(3, 128, torch.float32), (18, 200, torch.bfloat16)])
@pytest.mark.parametrize("keep", [False, True])
def test_silu_and_mul_fp8_kernel_matches_the_reference(nv, t, inter, dtype, keep):
    """The SiLU-and-mul that quantizes its output: the values silu_and_mul writes (kept or not), their reference
    quantization, padded rows zeros; the contract's default gives the same layout."""
    g = torch.Generator().manual_seed(t + inter)
    x = (torch.randn(t, 2 * inter, generator=g) * 4).to(dtype)
    act = nv.silu_and_mul_fp8(x, keep_values=keep)
    ref = nv.silu_and_mul(x)
    assert (act.x is None) != keep and act.rows == t
    _check_act(act if keep else dataclasses.replace(act, x=ref), ref)
    if not keep:
        with pytest.raises(BackendError, match="not kept"):
            act.values()
    cpu_act = CPUBackend().silu_and_mul_fp8(x, keep_values=True)
    _check_act(cpu_act, cpu_act.x)


def test_fp8_act_reference_layout():
    x = torch.randn(3, 130)
    act = fp8_act_reference(x)
    _check_act(act, x)


def _counting(base):
    class Counting(base):
        calls = 0
        silu_calls = 0

        def rms_norm_fp8(self, x, residual, weight, eps):
            self.calls += 1
            return super().rms_norm_fp8(x, residual, weight, eps)

        def silu_and_mul_fp8(self, x, keep_values=False):
            self.silu_calls += 1
            return super().silu_and_mul_fp8(x, keep_values)

    return Counting


def _decoder_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "DecoderLayer"]


def test_w8a8_model_same_bits_with_the_norm_quant(tmp_path, monkeypatch):
    """tiny-v3-fp8 run W8A8 on the nvidia op (interpreter) at 4 tokens, with every W8A8 consumer past its fused-quant
    size (the linears' GEMMs quantize apart at any M, the MoE runs the aligned schedule): with the norm writing the
    quantization (each layer's two norms and each MLP's SiLU-and-mul take the fused path: counted), the logits are the
    unfused path's bits."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("DEEPINFER_FP8_FUSED_ACT_QUANT_MAX_M", "0")
    monkeypatch.setenv("DEEPINFER_MOE_FUSED_ROUTER_MAX_TOKENS", "0")
    monkeypatch.setenv("DEEPINFER_MOE_DIRECT_MAX_PAIRS", "0")
    from deepinfer.backends.nvidia.backend import NvidiaBackend
    from deepinfer.checkpoints import make_checkpoint

    path = str(tmp_path / "fp8")
    make_checkpoint("tiny-v3-fp8", path, seed=3)
    backend = _counting(NvidiaBackend)(device="cpu")
    with use_linear_quant(LinearQuantSettings(fp8_activations=True)):
        model = load_model(path, backend, torch.float32, progress=False)
    layers = _decoder_layers(model)
    moes = [m for m in model.modules() if type(m).__name__ == "MoELayer"]
    assert moes and all(m.op.quant.scheme == "fp8_w8a8" and m.takes_fp8_act(4) for m in moes)
    assert all(layer.self_attn.takes_fp8_act(4) for layer in layers)
    ids = torch.randint(2, 500, (1, 4), generator=torch.Generator().manual_seed(1))
    mlps = [m for m in model.modules() if type(m).__name__ == "GatedMLP"]  # layer 0's MLP, the shared experts
    assert len(mlps) == len(layers) and all(m.down_proj.takes_fp8_act(4) for m in mlps)
    logits = {}
    for on in (False, True):
        for module in layers + mlps:
            module.fp8_norm_quant = module.fp8_epilogue_quant = on
        backend.calls = backend.silu_calls = 0
        logits[on] = prefill_logits(model, backend, ids)
        assert backend.calls == (2 * len(layers) if on else 0)
        assert backend.silu_calls == (len(mlps) if on else 0)
    torch.testing.assert_close(logits[True], logits[False], atol=0, rtol=0)


def test_fp8_act_given_where_the_op_does_not_take_one(nv):
    """fused_moe's x_quant is the W8A8 aligned schedule's input only: given to dense experts it is an error that
    names it, not an ignored argument."""
    from deepinfer.backends.nvidia.fused_moe import fused_moe

    x = torch.randn(4, 128)
    w13, w2 = torch.randn(2, 64, 128), torch.randn(2, 128, 32)
    act = fp8_act_reference(x)
    with pytest.raises(BackendError, match="x_quant"):
        fused_moe(x, w13, w2, torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.int64), direct=False,
                  x_quant=(act.q, act.s))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_act_quant_real_shapes_gpu():
    """On the GPU at V2-Lite's shapes (256 and 1000 tokens, hidden 2048, expert width 1408): the norm + quant and the
    SiLU-and-mul + quant equal the unfused kernels bit for bit, cuBLAS's block-scaled GEMM on them equals
    blockscaled_linear's, and the W8A8 fused MoE on the norm's quantization equals the one that quantizes x itself."""
    from deepinfer.backend import quantize_weight_fp8_block
    from deepinfer.backends.nvidia.activation import silu_and_mul
    from deepinfer.backends.nvidia.fused_moe import fused_moe
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8 as triton_quant
    from deepinfer.backends.nvidia.quant.fp8_act_quant import silu_mul_fp8_act
    from deepinfer.backends.nvidia.quant.fp8_cublas import blockscaled_linear, blockscaled_mm, k4_scales, use_cublas
    from deepinfer.backends.nvidia.quant.rmsnorm_fp8 import rms_norm_fp8
    from deepinfer.backends.nvidia.rmsnorm import add_rms_norm

    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    wq, ws = quantize_weight_fp8_block(torch.randn(3648, 2048, device=dev, generator=g) * 0.05)
    for t in (256, 1000):
        x = torch.randn(t, 2048, device=dev, generator=g).to(bf16) * 3
        r = torch.randn(t, 2048, device=dev, generator=g).to(bf16)
        w = torch.rand(2048, device=dev, generator=g).to(bf16) + 0.5
        act, total = rms_norm_fp8(x, r, w, 1e-6)
        out, tot = add_rms_norm(x, r, w, 1e-6)
        q, s = triton_quant(out, scales_col_major=True, pad_rows_to=16)
        assert torch.equal(act.x, out) and torch.equal(total, tot) and torch.equal(act.s_cm, s)
        assert torch.equal(act.s, s) and torch.equal(act.q.view(torch.uint8), q.view(torch.uint8))
        if use_cublas(out, wq, False):
            k4 = k4_scales(ws)
            assert torch.equal(blockscaled_mm(act.q, act.s_cm, t, wq, k4, bf16), blockscaled_linear(out, wq, k4, bf16))
        h2 = torch.randn(t, 2 * 1408, device=dev, generator=g).to(bf16) * 3
        sact = silu_mul_fp8_act(h2, keep_values=True)
        h = silu_and_mul(h2)
        q, s = triton_quant(h, scales_col_major=True, pad_rows_to=16)
        assert torch.equal(sact.x, h) and torch.equal(sact.s_cm, s)
        assert torch.equal(sact.q.view(torch.uint8), q.view(torch.uint8))
    e, d, i, k, t = 64, 2048, 1408, 6, 256
    q13 = [quantize_weight_fp8_block(torch.randn(2 * i, d, device=dev, generator=g) * 0.02) for _ in range(e)]
    q2 = [quantize_weight_fp8_block(torch.randn(d, i, device=dev, generator=g) * 0.02) for _ in range(e)]
    kw = {"w13": torch.stack([a for a, _ in q13]), "w13_scale": torch.stack([b for _, b in q13]),
          "w2": torch.stack([a for a, _ in q2]), "w2_scale": torch.stack([b for _, b in q2]), "scheme": "fp8_w8a8"}
    x = torch.randn(t, d, device=dev, generator=g).to(bf16)
    act, _ = rms_norm_fp8(x, None, torch.ones(d, device=dev, dtype=bf16), 1e-6)
    ids = torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(t)])
    tw = torch.rand(t, k, device=dev, generator=g)
    want = fused_moe(act.x, topk_weights=tw, topk_ids=ids, direct=False, **kw)
    got = fused_moe(act.x, topk_weights=tw, topk_ids=ids, direct=False, x_quant=(act.q, act.s), **kw)
    assert torch.equal(got, want)
