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
    ({"method": "fp4", "activation_bits": 8}, "method fp4 with activation_bits 8.*W4A16"),
    ({"method": "fp4", "group_size": 128}, "group_size 128: fp4 supports only 32"),
    ({"method": "fp4", "weight_bits": 8}, "method fp4 with weight_bits 8"),
    ({"method": "fp4", "fuse_quant_dequant": True}, "fuse_quant_dequant true with method fp4"),
    ({"method": "int4", "activation_bits": 8}, "activation_bits 8.*weight-only"),
    ({"method": "fp8", "weight_bits": 4}, "weight_bits 4"),
    ({"method": "fp8", "group_size": 64}, "group_size 64"),
    ({"method": "fp8", "activation_bits": 16, "fuse_quant_dequant": True},
     "fuse_quant_dequant true.*activation_bits 16"),
    ({"method": "awq", "fuse_quant_dequant": True}, "fuse_quant_dequant true with method awq"),
    ({"method": "fp8", "fuse_quant_dequant": None}, "fuse_quant_dequant must be true or false"),
    ({"method": "fp8", "fuse_quant_dequant": "yes"}, "fuse_quant_dequant must be true or false"),
    ({"method": "nf4"}, "method must be one of"),
])
def test_bad_files_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        parse_quant_config(data)


def test_fuse_quant_dequant_maps_onto_the_fused_act_quant(tmp_path):
    """The file's fuse_quant_dequant reaches the load's settings on the W8A8 paths (left out: None, the env knob
    decides); W8A16 has no activation quant, so false there sets nothing."""
    def settings(data, ckpt):
        return resolve_linear_quant(None, parse_quant_config(data), ckpt)[0]

    assert settings({"method": "fp8", "fuse_quant_dequant": True}, FP8_CKPT) == \
        LinearQuantSettings(fp8_activations=True, fuse_act_quant=True)
    assert settings({"method": "fp8", "fuse_quant_dequant": False}, FP8_CKPT).fuse_act_quant is False
    assert settings({"method": "fp8"}, FP8_CKPT).fuse_act_quant is None
    assert settings({"method": "fp8", "fuse_quant_dequant": True}, {}) == \
        LinearQuantSettings(online="fp8", fuse_act_quant=True)
    assert settings({"method": "fp8", "activation_bits": 16, "fuse_quant_dequant": False}, FP8_CKPT) == \
        LinearQuantSettings(fp8_activations=False)
    f = tmp_path / "quant.yaml"
    f.write_text("method: fp8\nfuse_quant_dequant: true\n")
    assert parse_quant_config(str(f)).fuse_quant_dequant is True


@pytest.mark.parametrize("file_says,env", [(False, "1"), (True, "0"), (None, "0"), (None, "1")])
def test_the_layers_follow_the_file_over_the_env_knob(tiny_v3_dir, monkeypatch, file_says, env):
    """A decoder layer's norms and an MLP's SiLU-and-mul write the W8A8 input where the file says so, whatever
    DEEPINFER_FP8_EPILOGUE_QUANT says (an explicit setting wins); left out of the file, the knob decides."""
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.deepseek_v3.config import parse_deepseek_config
    from deepinfer.models.deepseek_v3.decoder_layer import DecoderLayer
    from deepinfer.models.layers.mlp import GatedMLP
    from deepinfer.models.registry import load_hf_config

    monkeypatch.setenv("DEEPINFER_FP8_EPILOGUE_QUANT", env)
    want = (env == "1") if file_says is None else file_says
    be = CPUBackend()
    cfg = parse_deepseek_config(load_hf_config(tiny_v3_dir))
    assert not cfg.is_moe_layer(0)
    with use_linear_quant(LinearQuantSettings(fp8_activations=True, fuse_act_quant=file_says)):
        mlp = GatedMLP(64, 128, be, torch.float32)
        layer = DecoderLayer(cfg, 0, be, torch.float32)
    assert mlp.fp8_epilogue_quant is want and layer.fp8_norm_quant is want
    assert layer.mlp.fp8_epilogue_quant is want


def test_a_backend_without_the_fused_act_quant_refuses_it(tmp_path):
    """fuse_quant_dequant: true on the cpu backend (its W8A8 linears quantize in their own op) is refused at
    start-up naming the key, before the weights load; nvidia declares it; false and left out pass."""
    from deepinfer.backend import BackendCaps, FeatureRequest
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.backends.nvidia.backend import NvidiaBackend
    from deepinfer.config import EngineConfig
    from deepinfer.engine import DeepInferenceEngine
    from deepinfer.errors import BackendError

    assert any("fuse_quant_dequant" in r for r in CPUBackend().caps.unsupported(FeatureRequest(fuse_act_quant=True)))
    assert not BackendCaps(fused_act_quant=True).unsupported(FeatureRequest(fuse_act_quant=True))
    assert NvidiaBackend(device="cpu").caps.fused_act_quant
    assert not CPUBackend().caps.unsupported(FeatureRequest(fuse_act_quant=False))
    from deepinfer.checkpoints import make_checkpoint

    path = str(tmp_path / "fp8")
    make_checkpoint("tiny-v3-fp8", path, seed=3)
    cfg = EngineConfig(model_name_or_path=path, device="cpu",
                       quantization_config={"method": "fp8", "fuse_quant_dequant": True})
    with pytest.raises(BackendError, match="fuse_quant_dequant true"):
        DeepInferenceEngine.from_config(cfg)


def test_fp4_runs_the_experts_a_checkpoint_stores_in_fp4():
    """method fp4 on a V4 checkpoint whose routed experts are fp4 loads it as stored (its fp8 linears as the checkpoint
    stores them); on any other checkpoint it is refused naming expert_dtype (no online fp4); a backend whose MoE op
    does not list fp4 refuses it at start-up."""
    from deepinfer.backend import BackendCaps, FeatureRequest
    from deepinfer.backends.cpu.backend import CPUBackend

    fp4_ckpt = {"quantization_config": {**FP8_CKPT["quantization_config"], "expert_dtype": "fp4",
                                        "scale_fmt": "ue8m0"}}
    qc = parse_quant_config({"method": "fp4"})
    assert (qc.weight_bits, qc.activation_bits, qc.group_size, qc.moe_scheme) == (4, 16, 32, "fp4")
    assert resolve_linear_quant(None, qc, fp4_ckpt) == (LinearQuantSettings(), "fp8_block")
    with pytest.raises(ConfigError, match="expert_dtype: fp4.*experts are fp8_block"):
        resolve_linear_quant(None, qc, FP8_CKPT)
    with pytest.raises(ConfigError, match="expert_dtype: fp4.*not quantized"):
        resolve_linear_quant(None, qc, {})
    with pytest.raises(ConfigError, match="disagree"):
        resolve_linear_quant("fp8", qc, fp4_ckpt)
    assert parse_quant_config({"method": "fp8"}).moe_scheme is None
    assert not CPUBackend().caps.unsupported(FeatureRequest(moe_quantization="fp4"))
    assert any("method fp4" in r for r in BackendCaps().unsupported(FeatureRequest(moe_quantization="fp4")))


def test_fp4_file_end_to_end_on_a_tiny_v4_fp4_checkpoint(tmp_path, tiny_v3_dir):
    """The engine takes `method: fp4` on a tiny V4 whose experts are stored fp4: they load as fp4 and the greedy
    tokens are those of the same checkpoint loaded without the file (as stored); on tiny-v3 the file is refused
    before any weight loads."""
    import json

    from deepinfer import SamplingParams
    from deepinfer.checkpoints import make_checkpoint
    from deepinfer.checkpoints.fp4_writer import write_fp4_checkpoint
    from deepinfer.checkpoints.presets_v4 import v4_tensor_plan
    from deepinfer.checkpoints.random_weights import write_safetensors
    from deepinfer.config import EngineConfig
    from deepinfer.engine import DeepInferenceEngine

    src, fp4 = tmp_path / "src", tmp_path / "fp4"
    make_checkpoint("tiny-v4", str(src), seed=3)  # the tokenizer; then fp8 linears, as V4 releases ship
    cfg = {**json.loads((src / "config.json").read_text()),
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (src / "config.json").write_text(json.dumps(cfg))
    write_safetensors(str(src), v4_tensor_plan(cfg, True), 1, torch.float32)
    assert write_fp4_checkpoint(str(src), str(fp4))
    tokens = {}
    for qc in ({"method": "fp4", "weight_bits": 4, "activation_bits": 16, "group_size": 32}, None):
        eng = DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=str(fp4), device="cpu",
                                                           quantization_config=qc, load_progress=False))
        moes = [m for m in eng.model.modules() if type(m).__name__ == "V4MoE"]
        assert moes and all(m.op.quant.scheme == "fp4" for m in moes)
        out = eng.generate(["def add(a, b):"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        tokens[qc is None] = out[0].outputs[0].token_ids
    assert len(tokens[True]) == 4 and tokens[True] == tokens[False]
    with pytest.raises(ConfigError, match="expert_dtype: fp4"):
        DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=tiny_v3_dir, device="cpu",
                                                     quantization_config={"method": "fp4"}))


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
