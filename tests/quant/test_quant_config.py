"""The quantization config file, its mapping onto LinearQuantSettings, online fp8 and fp8's memory."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.models.layers.linear import Linear
from deepinfer.models.layers.quant import LinearQuantSettings, use_linear_quant
from deepinfer.models.registry import load_model
from deepinfer.quant_config import parse_quant_config, resolve_linear_quant

FP8_CKPT = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
AWQ_CKPT = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}}


def test_yaml_file_maps_onto_settings(tmp_path):
    f = tmp_path / "quant.yaml"
    f.write_text("method: fp8\nweight_bits: 8\nactivation_bits: 16\ngroup_size: 128\nfuse_quant_dequant: false\n")
    qc = parse_quant_config(str(f))
    assert resolve_linear_quant(None, qc, FP8_CKPT) == (LinearQuantSettings(fp8_activations=False), "fp8_block")
    assert resolve_linear_quant("fp8", None, FP8_CKPT) == (LinearQuantSettings(fp8_activations=True), "fp8_w8a8")
    assert resolve_linear_quant("fp8", None, {}) == (LinearQuantSettings(online="fp8"), "fp8_w8a8")
    assert resolve_linear_quant(None, parse_quant_config({"method": "awq"}), AWQ_CKPT)[1] == "int4_awq"
    assert resolve_linear_quant(None, None, AWQ_CKPT)[1] == "int4_awq"


@pytest.mark.parametrize("data,match", [
    ({"method": "fp8", "bits": 8}, "unknown key.*bits"),
    ({"method": "fp4"}, "fp4.*no linear method"),
    ({"method": "int4", "activation_bits": 8}, "activation_bits 8.*weight-only"),
    ({"method": "fp8", "weight_bits": 4}, "weight_bits 4"),
    ({"method": "fp8", "group_size": 64}, "group_size 64"),
    ({"method": "fp8", "fuse_quant_dequant": True}, "fuse_quant_dequant true"),
    ({"method": "nf4"}, "method must be one of"),
])
def test_bad_files_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        parse_quant_config(data)


def test_impossible_combinations_with_the_checkpoint():
    with pytest.raises(ConfigError, match="no online int4"):
        resolve_linear_quant(None, parse_quant_config({"method": "int4"}), {})
    with pytest.raises(ConfigError, match="disagree"):
        resolve_linear_quant("fp8", parse_quant_config({"method": "awq"}), AWQ_CKPT)
    with pytest.raises(ConfigError, match="online fp8 quantization runs W8A8"):
        resolve_linear_quant(None, parse_quant_config({"method": "fp8", "activation_bits": 16}), {})


def test_engine_config_checks_the_file(tmp_path):
    from deepinfer.config import EngineConfig

    with pytest.raises(ConfigError, match="unknown key"):
        EngineConfig(model_name_or_path=str(tmp_path), quantization_config={"method": "fp8", "oops": 1})


def _param_bytes(model) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, Linear):
            for t in (m.weight, m.weight_scale_inv, m.bias):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def test_online_fp8_quantizes_at_load_and_halves_linear_memory(tiny_v3_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from deepinfer.backends.nvidia.backend import NvidiaBackend

    be = NvidiaBackend(device="cpu")
    dense = load_model(tiny_v3_dir, be, torch.bfloat16, progress=False)
    with use_linear_quant(LinearQuantSettings(online="fp8")):
        q = load_model(tiny_v3_dir, be, torch.bfloat16, progress=False)
    lins = [m for m in q.modules() if isinstance(m, Linear) and m.method is not None and m is not q.lm_head]
    assert lins and all(m.method.scheme == "fp8_w8a8" and m.weight.dtype == torch.float8_e4m3fn for m in lins)
    assert q.lm_head.method.scheme == "none" and q.lm_head.weight.dtype == torch.bfloat16  # the head stays dense
    head = q.lm_head.weight.numel() * 2
    ratio = (_param_bytes(q) - head) / (_param_bytes(dense) - head)
    assert 0.5 <= ratio < 0.56, ratio  # e4m3 bytes + one fp32 scale per 128x128 block


def test_int4_group_sizes():
    ckpt64 = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64}}
    assert resolve_linear_quant(None, parse_quant_config({"method": "gptq"}), ckpt64)[1] == "int4_gptq"
    assert resolve_linear_quant(None, parse_quant_config({"method": "int4", "group_size": 64}), ckpt64)[1] == \
        "int4_gptq"
    with pytest.raises(ConfigError, match="group_size 128, but the checkpoint's quantization_config has group_size 64"):
        resolve_linear_quant(None, parse_quant_config({"method": "gptq", "group_size": 128}), ckpt64)
    with pytest.raises(ConfigError, match="group_size 48: int4 supports 32, 64, 128"):
        parse_quant_config({"method": "awq", "group_size": 48})
    from deepinfer.errors import UnsupportedModelError
    from deepinfer.quant_config import int4_checkpoint_format

    with pytest.raises(UnsupportedModelError, match="group_size 256 is not supported"):
        int4_checkpoint_format({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 256}})
