"""`--quantization fp8` on a bf16 checkpoint: the routed experts are quantized as they load and stay e4m3 in the
MoE op as "fp8_w8a8" (W8A8, as the linears), on the cpu op (the oracle) and the nvidia Triton op alike; the
two agree on a whole model; densifying them instead (an op without the scheme) is a different computation."""

from __future__ import annotations

import pytest
import torch
from quant_testutil import prefill_logits

from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.backends.cpu.ops_moe import CPUMoE
from deepinfer.models.layers.quant import LinearQuantSettings, use_linear_quant
from deepinfer.models.registry import load_model


class _NoQuantMoE(CPUMoE):
    def quantized_expert_schemes(self):
        return ()


class _DensifyingCPU(CPUBackend):
    def make_moe(self, spec):
        return _NoQuantMoE(spec, route_fn=self.route, silu_and_mul=self.silu_and_mul,
                           dense_max_work=self.moe_dense_max_work)


def _load(path, backend):
    with use_linear_quant(LinearQuantSettings(online="fp8")):
        return load_model(path, backend, torch.float32, progress=False)


def _moes(model):
    return [m for m in model.modules() if type(m).__name__ == "MoELayer"]


def test_online_fp8_keeps_experts_fp8_w8a8(tiny_v3_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from deepinfer.backends.nvidia.backend import NvidiaBackend

    cpu, nv, dense_be = CPUBackend(), NvidiaBackend(device="cpu"), _DensifyingCPU()
    kept, kept_nv, dense = _load(tiny_v3_dir, cpu), _load(tiny_v3_dir, nv), _load(tiny_v3_dir, dense_be)
    for model in (kept, kept_nv):
        moes = _moes(model)
        assert moes and all(m.quantized_experts and m.op.quant.scheme == "fp8_w8a8" for m in moes)
        assert all(m.op.quant.w13.dtype == torch.float8_e4m3fn and m.op.w13 is None for m in moes)
    # tiny-v3's shared MLP is 64 wide: the linear quantizes gate and up as one matrix whose 128-row blocks
    # straddle them, so the shared experts cannot be cut into fp8 expert slots with the same values: not folded
    assert not any(m.op.quant_shared is not None for m in _moes(kept_nv))
    for mk, md in zip(_moes(kept), _moes(dense)):
        assert not md.quantized_experts
        q = mk.op.quant
        assert q.w13.shape == md.op.w13.shape and q.w2.shape == md.op.w2.shape
        assert q.w13.element_size() == 1 and md.op.w13.element_size() == 4  # 1 byte per weight against fp32's 4
        # the densified twin holds the same fp8-rounded weights
        torch.testing.assert_close(md.op.w13, _dequant_w13(q), atol=0, rtol=0)
    ids = torch.randint(2, 500, (1, 9), generator=torch.Generator().manual_seed(0))
    lk, lnv, ld = (prefill_logits(m, b, ids) for m, b in ((kept, cpu), (kept_nv, nv), (dense, dense_be)))
    torch.testing.assert_close(lnv, lk, atol=1e-4, rtol=0)  # Triton W8A8 kernels vs the oracle: same values
    assert (lk - ld).abs().max() > 1e-3  # the experts' activations are quantized (the densified op does not)


def _dequant_w13(q) -> torch.Tensor:
    from deepinfer.backend.native.moe import dequant_expert

    return torch.stack([dequant_expert(q, e, torch.float32)[0] for e in range(q.w13.shape[0])])


@pytest.mark.parametrize("online", [None, "fp8"])
def test_fp8_checkpoint_experts_follow_the_activation_setting(online, tmp_path_factory):
    """An fp8 checkpoint's experts run W8A16 ("fp8_block") by default and W8A8 when the load asks for fp8
    activations (`--quantization fp8` on an fp8 checkpoint), as its linears do."""
    from deepinfer.checkpoints import make_checkpoint

    out = str(tmp_path_factory.mktemp("tiny-v3-fp8"))
    make_checkpoint("tiny-v3-fp8", out, seed=3)
    settings = LinearQuantSettings(fp8_activations=online == "fp8")
    with use_linear_quant(settings):
        model = load_model(out, CPUBackend(), torch.float32, progress=False)
    want = "fp8_w8a8" if online else "fp8_block"
    assert all(m.op.quant.scheme == want for m in _moes(model))


def test_quantized_shared_experts_fold_into_the_direct_gemms(tmp_path, monkeypatch):
    """Beside quantized routed experts, the nvidia op takes the shared experts as extra expert slots in the same
    scheme (fuse_shared_quantized) and the direct GEMMs run them (weight 1.0): fp8 checkpoint run W8A8, and an
    AWQ copy at group 64 (every expert projection int4), each against the cpu op (the oracle, shared MLP run
    through the linears) on a whole tiny-v3."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from deepinfer.backends.nvidia.backend import NvidiaBackend
    from deepinfer.checkpoints import make_checkpoint
    from deepinfer.checkpoints.awq_writer import write_int4_checkpoint

    fp8_dir, awq_dir = str(tmp_path / "fp8"), str(tmp_path / "awq")
    make_checkpoint("tiny-v3-fp8", fp8_dir, seed=3)
    dense_dir = str(tmp_path / "dense")
    make_checkpoint("tiny-v3", dense_dir, seed=3)
    write_int4_checkpoint(dense_dir, awq_dir, "awq", group=64)
    # 3 tokens (x 4 routed + 1 shared expert): the interpreter runs a direct-GEMM program per pair and N tile (9 tokens
    # took ~45 s here)
    ids = torch.randint(2, 500, (1, 3), generator=torch.Generator().manual_seed(0))
    for path, settings, scheme in ((fp8_dir, LinearQuantSettings(fp8_activations=True), "fp8_w8a8"),
                                   (awq_dir, LinearQuantSettings(), "int4_awq")):
        cpu, nv = CPUBackend(), NvidiaBackend(device="cpu")
        with use_linear_quant(settings):
            ref, ours = (load_model(path, b, torch.float32, progress=False) for b in (cpu, nv))
        moes = _moes(ours)
        assert moes and all(m.op.quant.scheme == scheme and m.op.quant_shared is not None for m in moes)
        e = moes[0].op.quant.w13.shape[0]
        assert moes[0].op.quant_shared.w13.shape[0] == e + 1  # tiny-v3: one shared expert
        assert moes[0].op.quant.w13.data_ptr() == moes[0].op.quant_shared.w13.data_ptr()  # views, one copy
        torch.testing.assert_close(prefill_logits(ours, nv, ids), prefill_logits(ref, cpu, ids), atol=1e-4, rtol=0)


def test_shared_experts_cut_into_fp8_slots_with_the_linears_values():
    """Online fp8, two shared experts of width 128: the slots dequantize to exactly the weights the shared MLP's
    own (fused gate_up, down) linears run with."""
    from deepinfer.backend.native.moe import dequant_expert
    from deepinfer.models.layers.mlp import GatedMLP
    from deepinfer.models.layers.quant.shared_experts import shared_as_quantized_experts

    g = torch.Generator().manual_seed(0)
    mlp = GatedMLP(256, 256, CPUBackend(), torch.float32)
    for name, t in {"s.gate_proj.weight": torch.randn(256, 256, generator=g), "s.up_proj.weight":
                    torch.randn(256, 256, generator=g), "s.down_proj.weight": torch.randn(256, 256, generator=g)}.items():
        mlp.loaders("s")[name](t)
    with use_linear_quant(LinearQuantSettings(online="fp8")):
        q = shared_as_quantized_experts(mlp, "fp8_w8a8", 128)
        mlp.finalize()
    gate_up, down = mlp.dense_weights()
    assert q is not None and q.w13.shape[0] == 2
    w13 = [dequant_expert(q, s, torch.float32) for s in range(2)]
    gate = torch.cat([w[0][:128] for w in w13])
    up = torch.cat([w[0][128:] for w in w13])
    torch.testing.assert_close(torch.cat([gate, up]), gate_up, atol=0, rtol=0)
    torch.testing.assert_close(torch.cat([w[1] for w in w13], dim=1), down, atol=0, rtol=0)
