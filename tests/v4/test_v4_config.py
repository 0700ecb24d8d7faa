"""deepseek_v4 config.json parsing, the hybrid KV layout it implies, and its memory per token / sequence."""

from __future__ import annotations

import pytest
import torch

from deepinfer.checkpoints import PRESETS
from deepinfer.checkpoints.presets_v4 import tiny_v4_config, v4_flash_config
from deepinfer.errors import ModelLoadError, UnsupportedModelError
from deepinfer.kv.planner import bytes_per_token, fixed_bytes_per_seq
from deepinfer.models.deepseek_v4.config import CSA, HCA, SWA, parse_v4_config
from deepinfer.models.deepseek_v4.model import v4_kv_cache_specs
from deepinfer.models.registry import model_class_for


def _base(**over) -> dict:
    cfg = tiny_v4_config()
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def test_compress_ratios_give_the_schedule_and_mtp_entries():
    cfg = parse_v4_config(_base(layer_types=None))
    assert cfg.layer_types == (SWA, CSA, HCA, CSA)
    assert cfg.mtp_layer_types == (CSA,)  # the entry past num_hidden_layers
    assert cfg.compress_rate(0) == 0 and cfg.compress_rate(1) == 4 and cfg.compress_rate(2) == 16
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")


def test_layer_types_are_the_fallback_and_must_agree():
    cfg = parse_v4_config(_base(compress_ratios=None))
    assert cfg.layer_types == (SWA, CSA, HCA, CSA) and cfg.mtp_layer_types == ()
    with pytest.raises(ModelLoadError, match="disagree"):
        parse_v4_config(_base(compress_ratios=[0, 4, 4, 4, 4]))
    with pytest.raises(UnsupportedModelError, match="compress ratio 8"):
        parse_v4_config(_base(compress_ratios=[0, 8, 16, 4], layer_types=None))


def test_reference_defaults_without_a_schedule():
    """No compress_ratios / layer_types / mlp_layer_types: the reference's defaults (2 HCA, then CSA/HCA; 3 hash)."""
    cfg = parse_v4_config(_base(compress_ratios=None, layer_types=None, mlp_layer_types=None, num_hidden_layers=5,
                                compress_rates=None))
    assert cfg.layer_types == (HCA, HCA, HCA, CSA, HCA)
    assert cfg.compress_rates == {CSA: 4, HCA: 128}
    assert cfg.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 2


def test_legacy_rate_and_hash_fields():
    cfg = parse_v4_config(_base(compress_rates=None, compress_rate_csa=4, compress_rate_hca=16, mlp_layer_types=None,
                                num_hash_layers=2))
    assert cfg.compress_rates == {CSA: 4, HCA: 16}
    assert cfg.mlp_layer_types == ("hash_moe", "hash_moe", "moe", "moe")


def test_rope_yarn_only_on_compressed_branches():
    cfg = parse_v4_config(_base())
    assert cfg.rope_main.rope_type == "default" and cfg.rope_main.theta == 10000.0
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.theta == 160000.0
    assert cfg.rope_compress.attention_factor == 1.0  # V4 does not scale cos/sin
    assert cfg.rope_main.rope_dim == cfg.rope_compress.rope_dim == 8
    assert cfg.rope_for(0) is cfg.rope_main and cfg.rope_for(1) is cfg.rope_compress
    nested = parse_v4_config(_base(rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "rope_theta": 90000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                     "partial_rotary_factor": 0.25, "attention_factor": 1.0}}))
    assert nested.rope_main.theta == 5000.0 and nested.rope_compress.factor == 8.0


def test_bad_configs_name_the_problem():
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads"):
        parse_v4_config(_base(num_key_value_heads=2))
    with pytest.raises(UnsupportedModelError, match="scoring_func"):
        parse_v4_config(_base(scoring_func="tanh"))
    with pytest.raises(ModelLoadError, match="moe_intermediate_size"):
        parse_v4_config({k: v for k, v in _base().items() if k != "moe_intermediate_size"})
    with pytest.raises(UnsupportedModelError, match="expert_dtype"):  # fp4 experts load (docs/quantization.md)
        parse_v4_config(_base(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                                   "expert_dtype": "int2"}))
    fp4 = parse_v4_config(_base(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                                     "expert_dtype": "fp4"}))
    assert fp4.expert_dtype == "fp4"


def test_registry_and_presets():
    assert model_class_for({"model_type": "deepseek_v4"}).__name__ == "DeepseekV4ForCausalLM"
    assert {"tiny-v4", "v4-flash-reduced"} <= set(PRESETS)
    tiny = parse_v4_config(PRESETS["tiny-v4"].hf_config())
    assert {SWA, CSA, HCA} <= set(tiny.layer_types) and "hash_moe" in tiny.mlp_layer_types
    assert tiny.index_n_heads >= 8 and tiny.num_nextn_predict_layers == 1
    reduced = parse_v4_config(PRESETS["v4-flash-reduced"].hf_config())
    assert reduced.quantization == "fp8_block" and reduced.hidden_size == 4096 and reduced.num_hidden_layers == 4


def test_kv_layout_and_v4_flash_memory():
    tiny = parse_v4_config(_base())
    specs = {s.name: s for s in v4_kv_cache_specs(tiny, torch.float32)}
    assert specs["v4_swa"].sliding_window == 8 and specs["v4_swa"].layer_ids == (0, 1, 2, 3)
    assert specs["v4_csa"].tokens_per_entry == 4 and specs["v4_csa"].layer_ids == (1, 3)
    assert specs["v4_idx"].entry_shape == (16,) and specs["v4_hca"].tokens_per_entry == 16
    assert specs["v4_csa"].state_shape == (8, 128) and specs["v4_hca"].state_shape == (16, 64)

    flash = v4_kv_cache_specs(parse_v4_config(v4_flash_config()), torch.bfloat16)
    # 21 CSA layers x (512 + 128) / 4 + 20 HCA layers x 512 / 128 values per token, 2 bytes each
    assert bytes_per_token(flash) == 21 * (512 + 128) / 4 * 2 + 20 * 512 / 128 * 2 == 6880.0
    # window: 128 keys x 512 x 43 layers; rings: CSA 8x2048, indexer 8x512, HCA 128x1024 per layer
    window = 128 * 512 * 2 * 43
    rings = (21 * (8 * 2048 + 8 * 512) + 20 * 128 * 1024) * 2
    assert fixed_bytes_per_seq(flash) == window + rings
