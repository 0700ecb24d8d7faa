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
