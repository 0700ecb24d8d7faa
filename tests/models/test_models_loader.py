"""Checkpoint loading (single / sharded / fp8 / MTP kept aside / errors naming tensors) and the checkpoint writer."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from model_refs import checkpoint, dequantize_reference, our_model, prompts
from paged_batch_util import PagedKV
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.checkpoints import PRESETS, make_checkpoint
from deepinfer.checkpoints.random_weights import deepseek_v3_tensor_plan, draw
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.models.registry import load_model


def copy_ckpt(preset: str, dst) -> str:
    dst = str(dst / preset)
    shutil.copytree(checkpoint(preset), dst)
    return dst


def rewrite(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def load(path: str):
    return load_model(path, CPUBackend(), torch.float32, progress=False)


def test_missing_tensor_is_named(tmp_path):
    path = copy_ckpt("tiny-v3", tmp_path)
    rewrite(path, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensors \(1\): model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        load(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = copy_ckpt("tiny-v2-lite", tmp_path)
    rewrite(path, lambda t: t.__setitem__("model.layers.0.self_attn.q_a_proj.weight", torch.zeros(8, 128)))
    with pytest.raises(ModelLoadError, match=r"unexpected tensors \(1\): model\.layers\.0\.self_attn\.q_a_proj\.weight"):
        load(path)


def test_wrong_shape_is_named(tmp_path):
    path = copy_ckpt("tiny-v2-lite", tmp_path)
    rewrite(path, lambda t: t.__setitem__("model.norm.weight", torch.ones(64)))
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight has shape \(64,\), expected \(128,\)"):
        load(path)


def test_mtp_layers_are_skipped_unless_asked_for(tmp_path):
    path = copy_ckpt("tiny-v3", tmp_path)
    mtp = {
        "model.layers.3.eh_proj.weight": torch.randn(128, 256),
        "model.layers.3.enorm.weight": torch.ones(128),
        "model.layers.3.self_attn.kv_a_layernorm.weight": torch.ones(64),
        "model.layers.4.shared_head.norm.weight": torch.ones(128),
    }
    rewrite(path, lambda t: t.update(mtp))
    model = load(path)
    assert model.skipped_mtp_tensors == len(mtp) and len(model.mtp) == 0
    # and the main model is unaffected
    (p,) = prompts(model.vocab_size, [9], seed=5)
    torch.testing.assert_close(PagedKV(model).step([(0, p)]), PagedKV(our_model("tiny-v3")).step([(0, p)]))


def test_sharded_checkpoint_index_and_missing_shard(tmp_path):
    path = copy_ckpt("tiny-v2", tmp_path)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not os.path.exists(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, shards[-1]))
    with pytest.raises(ModelLoadError, match=shards[-1]):
        load(path)


def test_empty_directory_and_unknown_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(str(tmp_path / "missing"))
    path = copy_ckpt("tiny-v3", tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        load(path)


def test_fp8_weight_without_scale_or_config(tmp_path):
    path = copy_ckpt("tiny-v3-fp8", tmp_path)
    rewrite(path, lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv"):
        load(path)
    path = copy_ckpt("tiny-v3-fp8", tmp_path / "b")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelLoadError, match="float8_e4m3fn but config.json declares no fp8"):
        load(path)


def test_model_attributes():
    m = our_model("tiny-v3-fp8")
    assert (m.vocab_size, m.max_position_embeddings, m.model_type, m.quantization) == (1024, 8192, "deepseek_v3", "fp8_block")
    (spec,) = m.kv_cache_specs()
    assert spec.name == "mla" and spec.layer_ids == (0, 1, 2) and spec.entry_shape == (64 + 16,)
    assert our_model("tiny-v2-lite").quantization is None and len(our_model("tiny-v2-lite").mtp) == 0


def test_fp8_checkpoint_format():
    path = checkpoint("tiny-v3-fp8")
    with open(os.path.join(path, "config.json")) as f:
        q = json.load(f)["quantization_config"]
    assert q == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    t = load_file(os.path.join(path, "model.safetensors"))
    w, s = t["model.layers.0.self_attn.q_b_proj.weight"], t["model.layers.0.self_attn.q_b_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (192, 96) and s.dtype == torch.float32 and s.shape == (2, 1)
    exact = draw(next(x for x in deepseek_v3_tensor_plan(PRESETS["tiny-v3-fp8"].hf_config(), True)
                      if x.name == "model.layers.0.self_attn.q_b_proj.weight"), seed=0)
    deq = dequantize_reference(w, s)
    assert ((deq - exact).abs() <= exact.abs() * 2**-4 + s.max() * 2**-9).all()  # e4m3: 3 mantissa bits, subnormal step 2^-9
    # experts, shared experts and dense MLPs are fp8; router, norms, embedding and head stay dense
    assert t["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert t["lm_head.weight"].dtype == t["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_make_checkpoint_is_deterministic_and_complete(tmp_path):
    make_checkpoint("tiny-v2-lite", str(tmp_path / "a"), seed=0)
    files = sorted(os.listdir(tmp_path / "a"))
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    gen = json.loads((tmp_path / "a" / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == open(os.path.join(checkpoint("tiny-v2-lite"), "model.safetensors"), "rb").read()
    make_checkpoint("tiny-v2-lite", str(tmp_path / "b"), seed=1)
    assert (tmp_path / "b" / "model.safetensors").read_bytes() != a
    with pytest.raises(ConfigError, match="unknown preset 'tiny-v9'"):
        make_checkpoint("tiny-v9", str(tmp_path / "c"))


def test_tokenizer_fits_the_vocab():
    from tokenizers import Tokenizer

    for preset in ("tiny-v2-lite", "tiny-v3"):
        tok = Tokenizer.from_file(os.path.join(checkpoint(preset), "tokenizer.json"))
        assert tok.get_vocab_size(with_added_tokens=True) <= PRESETS[preset].config["vocab_size"]


def test_v2_lite_preset_has_the_real_shapes():
    p = PRESETS["v2-lite"]
    cfg = p.hf_config()
    plan = deepseek_v3_tensor_plan(cfg, p.fp8)
    params = sum(torch.Size(s.shape).numel() for s in plan)
    assert 15.6e9 < params < 15.8e9  # DeepSeek-V2-Lite: 15.7B parameters
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"],
            cfg["n_shared_experts"], cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["vocab_size"]) == (
        27, 2048, 64, 6, 2, None, 512, 102400)
    assert p.dtype == "bfloat16" and p.max_shard_bytes is not None
    # the same plan at tiny size is exactly what transformers expects (checked in the parity tests)
    names = {s.name for s in plan}
    assert "model.layers.26.mlp.experts.63.down_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names


def test_streaming_writer_output_is_standard_safetensors():
    path = checkpoint("tiny-v2")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == shard
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    assert total == index["metadata"]["total_size"]


def test_dense_weight_with_a_block_scale_is_refused(tmp_path):
    path = copy_ckpt("tiny-v3-fp8", tmp_path)
    rewrite(path, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(256, 128)))
    with pytest.raises(ModelLoadError, match=r"o_proj\.weight_scale_inv is given but .*o_proj\.weight is not fp8"):
        load(path)


def test_engine_start_reads_config_json_once(monkeypatch):
    """DeepInferenceEngine._start parses config.json once and hands the dict to load_model; load_model
    without it (tests, benchmarks, conformance) still reads the file itself."""
    import builtins

    import deepinfer.models.registry as registry
    from deepinfer import DeepInferenceEngine, EngineConfig

    path = checkpoint("tiny-v2-lite")
    config_file = os.path.realpath(os.path.join(path, "config.json"))
    opens, parses = [], []
    real_open, real_load_hf_config = builtins.open, registry.load_hf_config

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(file)) == config_file:
            opens.append(file)
        return real_open(file, *args, **kwargs)

    def counting_load_hf_config(p):
        parses.append(p)
        return real_load_hf_config(p)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(registry, "load_hf_config", counting_load_hf_config)
    DeepInferenceEngine.from_config(
        EngineConfig(model_name_or_path=path, device="cpu", max_model_len=32, num_kv_blocks=8, load_progress=False)
    )
    assert (len(opens), len(parses)) == (1, 1), f"config.json opened {len(opens)}x, parsed {len(parses)}x at start-up"

    load(path)  # no hf_config: reads it
    assert (len(opens), len(parses)) == (2, 2)
    hf_config = real_load_hf_config(path)
    before = len(opens)
    load_model(path, CPUBackend(), torch.float32, progress=False, hf_config=hf_config)
    assert (len(opens), len(parses)) == (before, 2)  # given the dict, load_model does not read the file
