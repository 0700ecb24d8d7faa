"""msModelSlim W8A8 dynamic checkpoints load as "int8_w8a8" and run like their dequantized dense model; the
oracle quantizes activations per token exactly as the int8 kernel does; bad checkpoints fail naming the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from quant_testutil import prefill_logits

from deepinfer.backend.native.quant_int8 import quantize_act_int8_per_token, w8a8_int8_linear_ref
from deepinfer.checkpoints.w8a8_writer import quantize_int8_per_channel, write_w8a8_checkpoint
from deepinfer.errors import ConfigError, ModelLoadError, UnsupportedModelError
from deepinfer.models.layers.linear import Linear
from deepinfer.models.registry import load_model
from deepinfer.quant_config import checkpoint_scheme, resolve_linear_quant


@pytest.fixture(scope="module")
def w8a8_dir(tiny_v3_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny-v3-w8a8"))
    return out, write_w8a8_checkpoint(tiny_v3_dir, out)


def test_activation_quant_is_symmetric_per_token_and_the_oracle_uses_it():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    x[1] = 0
    q, s = quantize_act_int8_per_token(x)
    assert q.dtype == torch.int8 and s.shape == (4,) and int(q.abs().max()) == 127 and not q[1].any()
    assert ((q.float() * s[:, None] - x).abs() <= s[:, None] / 2 + 1e-7).all()  # round to nearest
    w = torch.randn(8, 64, generator=g)
    y = w8a8_int8_linear_ref(x, w, None)
    torch.testing.assert_close(y, (q.float() * s[:, None]) @ w.t(), rtol=0, atol=0)
    assert not torch.equal(y, x @ w.t())  # the activations really are quantized
    qw, ws = quantize_int8_per_channel(w)
    assert qw.dtype == torch.int8 and ws.shape == (8, 1)
    assert ((qw.float() * ws - w).abs() <= ws / 2 + 1e-7).all()


def test_config_markers_map_to_int8_w8a8():
    assert checkpoint_scheme({"quantize": "w8a8_dynamic"}) == "int8_w8a8"
    # the compressed-tensors block some exports write beside `quantize` describes the same recipe
    assert checkpoint_scheme({"quantize": "w8a8_dynamic",
                              "quantization_config": {"quant_method": "compressed-tensors"}}) == "int8_w8a8"
    with pytest.raises(UnsupportedModelError, match="quantize 'w8a16'"):
        checkpoint_scheme({"quantize": "w8a16"})
    with pytest.raises(ModelLoadError, match="disagree"):
        checkpoint_scheme({"quantize": "w8a8_dynamic", "quantization_config": {"quant_method": "fp8"}})
    settings, scheme = resolve_linear_quant(None, None, {"quantize": "w8a8_dynamic"})
    assert scheme == "int8_w8a8" and settings.online is None
    with pytest.raises(ConfigError, match="int8_w8a8"):
        resolve_linear_quant("fp8", None, {"quantize": "w8a8_dynamic"})


def _linears(model):
    return {m.name: m for m in model.modules() if isinstance(m, Linear)}


def test_w8a8_checkpoint_loads_and_matches_its_dequantized_dense_model(w8a8_dir, tiny_v3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from deepinfer.backends.cpu.backend import CPUBackend

    path, prefixes = w8a8_dir
    assert any(".experts." in p for p in prefixes) and any("self_attn" in p for p in prefixes)
    be = CPUBackend()
    model = load_model(path, be, torch.float32, progress=False)
    raw = load_file(f"{path}/model.safetensors")
    by_hand = {p: raw[p + ".weight"].float() * raw[p + ".weight_scale"].float() for p in prefixes}
    int8_layers = [m for m in _linears(model).values() if m.method.scheme == "int8_w8a8"]
    assert int8_layers, "no linear runs the int8_w8a8 method"
    for layer in int8_layers:
        torch.testing.assert_close(layer.dense(), by_hand[layer.name], rtol=0, atol=0)
    # the dense model whose weights are those dequantized values (experts included), run unquantized
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(tiny_v3_dir, ref_dir)
    dense_t = dict(load_file(f"{tiny_v3_dir}/model.safetensors"))
    dense_t.update({p + ".weight": w for p, w in by_hand.items()})
    save_file(dense_t, f"{ref_dir}/model.safetensors")
    ref_model = load_model(str(ref_dir), be, torch.float32, progress=False)
    ids = torch.tensor([[3, 17, 42, 5, 99, 7]])
    a, b = prefill_logits(model, be, ids), prefill_logits(ref_model, be, ids)
    assert not torch.equal(a, b)  # int8 activations: not the same numbers ...
    # ... but within int8 per-token activation rounding (~0.4% per linear, a few layers deep)
    torch.testing.assert_close(a, b, rtol=0, atol=3e-2 * b.abs().max().item())


def _copy(w8a8_dir, tmp_path):
    dst = tmp_path / "broken"
    shutil.copytree(w8a8_dir[0], dst)
    return dst


def test_incomplete_or_unlisted_int8_linear_is_an_error(w8a8_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from deepinfer.backends.cpu.backend import CPUBackend

    prefix = w8a8_dir[1][0]
    dst = _copy(w8a8_dir, tmp_path)
    t = load_file(f"{dst}/model.safetensors")
    del t[prefix + ".weight_scale"]
    save_file(t, f"{dst}/model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{prefix} lacks {prefix}\.weight_scale"):
        load_model(str(dst), CPUBackend(), torch.float32, progress=False)
    desc = json.loads((dst / "quant_model_description.json").read_text())
    desc[prefix + ".weight"] = "FLOAT"
    (dst / "quant_model_description.json").write_text(json.dumps(desc))
    with pytest.raises(ModelLoadError, match="not listed as W8A8_DYNAMIC"):
        load_model(str(dst), CPUBackend(), torch.float32, progress=False)
    desc[prefix + ".weight"] = "W4A8_DYNAMIC"
    (dst / "quant_model_description.json").write_text(json.dumps(desc))
    with pytest.raises(UnsupportedModelError, match="W4A8_DYNAMIC"):
        load_model(str(dst), CPUBackend(), torch.float32, progress=False)
    (dst / "quant_model_description.json").unlink()
    with pytest.raises(ModelLoadError, match="quant_model_description.json does not exist"):
        load_model(str(dst), CPUBackend(), torch.float32, progress=False)
