"""AWQ / GPTQ checkpoints written in the formats' exact packing load as int4 and match their dequantized reference."""

from __future__ import annotations

import pytest
import torch
from quant_testutil import prefill_logits

from deepinfer.backend import Int4Weight, dequant_int4
from deepinfer.backend.native.quant_int4 import unpack_awq, unpack_gptq_cols, unpack_gptq_rows
from deepinfer.checkpoints.awq_writer import pack_awq_cols, pack_gptq, quantize_int4
from deepinfer.errors import ModelLoadError
from deepinfer.models.layers.linear import Linear
from deepinfer.models.registry import load_model


def test_awq_packing_known_word():
    # columns 0..7 hold 1..8: AWQ's slot order (0, 2, 4, 6, 1, 3, 5, 7) puts column 2 (value 3) in bits 4..7
    v = torch.arange(1, 9).view(1, 8)
    word = int(pack_awq_cols(v)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [1, 3, 5, 7, 2, 4, 6, 8]
    assert torch.equal(unpack_awq(pack_awq_cols(v)), v.to(torch.int32))


def test_unpack_inverts_the_writers_packing():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (256, 24), generator=g)
    z = torch.randint(1, 16, (2, 24), generator=g)
    assert torch.equal(unpack_awq(pack_awq_cols(q)), q.to(torch.int32))
    qw, qz = pack_gptq(q, z)
    assert torch.equal(unpack_gptq_rows(qw), q.to(torch.int32))
    assert torch.equal(unpack_gptq_cols(qz) + 1, z.to(torch.int32))  # GPTQ v1 stores zero - 1


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dequant_is_close_to_the_dense_weight(method):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 256, generator=g) * 0.05
    q, z, s = quantize_int4(w)
    if method == "awq":
        rec = Int4Weight("awq", pack_awq_cols(q), pack_awq_cols(z), s)
    else:
        qw, qz = pack_gptq(q, z)
        rec = Int4Weight("gptq", qw, qz, s, (torch.arange(256) // 128).to(torch.int32), zero_offset=1)
    rec.check("x", 24, 256)
    deq = dequant_int4(rec)
    # round-to-nearest: every element within half a step of its group's scale
    step = s.float().repeat_interleave(128, 0).t()
    assert ((deq - w).abs() <= step * 0.5 + 1e-6).all()


def test_int4_record_errors_name_the_tensor():
    rec = Int4Weight("awq", torch.zeros(256, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32),
                     torch.zeros(2, 24, dtype=torch.float16))
    with pytest.raises(ModelLoadError, match=r"p\.qweight has shape \(256, 3\), expected \(256, 4\)"):
        rec.check("p", 32, 256)
    gp = Int4Weight("gptq", torch.zeros(32, 24, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32),
                    torch.zeros(2, 24, dtype=torch.float16), None)
    with pytest.raises(ModelLoadError, match="g_idx is missing"):
        gp.check("p", 24, 256)


def _linears(model):
    return {m.name: m for m in model.modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoint_loads_and_matches_its_dequantized_reference(method, int4_dirs, tiny_v3_dir, tmp_path):
    from deepinfer.backends.cpu.backend import CPUBackend

    path, prefixes = int4_dirs[method]
    assert prefixes, "the writer quantized no linear"
    be = CPUBackend()
    model = load_model(path, be, torch.float32, progress=False)
    lins = _linears(model)
    int4_layers = [m for m in lins.values() if m.method.scheme == f"int4_{method}"]
    assert int4_layers, "no linear runs the int4 method"
    # the dequantized reference: the same checkpoint's packed tensors through the reference formula, by hand
    from safetensors.torch import load_file

    raw = load_file(f"{path}/model.safetensors")

    def by_hand(p):
        q = (unpack_awq(raw[p + ".qweight"]) if method == "awq" else unpack_gptq_rows(raw[p + ".qweight"])).float()
        z = (unpack_awq(raw[p + ".qzeros"]) if method == "awq" else unpack_gptq_cols(raw[p + ".qzeros"]) + 1).float()
        s = raw[p + ".scales"].float()
        rows = torch.arange(q.shape[0]) // 128
        return ((q - z[rows]) * s[rows]).t().contiguous()

    for layer in int4_layers:  # a fused gate_up / q+kv_a (its records concatenated) is its parts side by side
        want = torch.cat([by_hand(part) for part in layer.name.split("+")])
        torch.testing.assert_close(layer.dense(), want, rtol=0, atol=0)
    assert any("+" in layer.name for layer in int4_layers)  # merged int4 parts run as one GEMM
    # and the model runs like the dense model whose weights are those dequantized values (experts included)
    import shutil

    from safetensors.torch import save_file

    ref_dir = tmp_path / "dequantized"
    shutil.copytree(tiny_v3_dir, ref_dir)
    dense_t = dict(load_file(f"{tiny_v3_dir}/model.safetensors"))
    for p in prefixes:
        dense_t[p + ".weight"] = by_hand(p)
    save_file(dense_t, f"{ref_dir}/model.safetensors")
    ref_model = load_model(str(ref_dir), be, torch.float32, progress=False)
    ids = torch.tensor([[3, 17, 42, 5, 99, 7]])
    a, b = prefill_logits(model, be, ids), prefill_logits(ref_model, be, ids)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def test_incomplete_int4_linear_is_an_error(int4_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path, prefixes = int4_dirs["awq"]
    dst = tmp_path / "broken"
    shutil.copytree(path, dst)
    t = load_file(f"{dst}/model.safetensors")
    del t[prefixes[0] + ".qzeros"]
    save_file(t, f"{dst}/model.safetensors")
    from deepinfer.backends.cpu.backend import CPUBackend

    with pytest.raises(ModelLoadError, match=rf"{prefixes[0]} lacks {prefixes[0]}\.qzeros"):
        load_model(str(dst), CPUBackend(), torch.float32, progress=False)
