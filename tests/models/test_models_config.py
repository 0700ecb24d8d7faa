"""config.json parsing: variants, routing derived per model_type, rope spellings, fp8, and errors that name the key."""

from __future__ import annotations

import json

import pytest

from deepinfer.checkpoints import PRESETS
from deepinfer.errors import ModelLoadError, UnsupportedModelError
from deepinfer.models.deepseek_v3.config import parse_deepseek_config
from deepinfer.models.registry import load_hf_config, model_class_for


def cfg(preset: str, **changes) -> dict:
    c = PRESETS[preset].hf_config()
    for k, v in changes.items():
        if v is ...:
            c.pop(k, None)
        else:
            c[k] = v
    return c


def test_variants_parse_to_their_routing():
    lite = parse_deepseek_config(cfg("tiny-v2-lite"))
    assert lite.q_lora_rank is None and lite.router_spec().topk_method == "greedy"
    assert lite.router_spec().scoring_func == "softmax"
    v2 = parse_deepseek_config(cfg("tiny-v2"))
    r = v2.router_spec()
    assert (r.topk_method, r.n_group, r.topk_group, r.routed_scaling_factor) == ("group_limited_greedy", 4, 2, 2.0)
    v3 = parse_deepseek_config(cfg("tiny-v3"))
    r = v3.router_spec()
    assert (r.scoring_func, r.topk_method, r.norm_topk_prob, r.routed_scaling_factor) == ("sigmoid", "noaux_tc", True, 2.5)
    assert v3.quantization is None and v3.q_lora_rank == 96
    fp8 = parse_deepseek_config(cfg("tiny-v3-fp8"))
    assert fp8.quantization == "fp8_block" and fp8.weight_block_size == (128, 128)
    assert [lite.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_routing_without_topk_method_or_scoring_func_follows_model_type_defaults():
    # HF's DeepseekV3 router is sigmoid + noaux_tc whatever the config says; V2's is softmax with topk_method greedy
    v3 = parse_deepseek_config(cfg("tiny-v3", topk_method=..., scoring_func=..., norm_topk_prob=...,
                                   routed_scaling_factor=...))
    assert (v3.scoring_func, v3.topk_method, v3.norm_topk_prob, v3.routed_scaling_factor) == (
        "sigmoid", "noaux_tc", True, 2.5)
    v2 = parse_deepseek_config(cfg("tiny-v2-lite", topk_method=..., scoring_func=...))
    assert (v2.scoring_func, v2.topk_method) == ("softmax", "greedy")
    # V3 without n_group takes HF's default 8 (16 experts -> groups of 2)
    assert parse_deepseek_config(cfg("tiny-v3", n_group=..., topk_group=...)).router_spec().n_group == 8


@pytest.mark.parametrize(
    "preset,key,value",
    [
        ("tiny-v3", "topk_method", "greedy"),
        ("tiny-v3", "scoring_func", "softmax"),
        ("tiny-v2", "topk_method", "noaux_tc"),
        ("tiny-v2", "scoring_func", "sigmoid"),
        ("tiny-v3", "hidden_act", "gelu"),
    ],
)
def test_routing_the_family_does_not_implement_is_refused(preset, key, value):
    with pytest.raises(UnsupportedModelError, match=key):
        parse_deepseek_config(cfg(preset, **{key: value}))


def test_v2_normalized_topk_is_not_also_scaled():
    # DeepSeek-V2's gate: normalize top-k weights, *else* multiply by routed_scaling_factor
    spec = parse_deepseek_config(cfg("tiny-v2", norm_topk_prob=True)).router_spec()
    assert spec.norm_topk_prob and spec.routed_scaling_factor == 1.0
    spec = parse_deepseek_config(cfg("tiny-v3", norm_topk_prob=True)).router_spec()
    assert spec.norm_topk_prob and spec.routed_scaling_factor == 2.5


def test_rope_scaling_and_rope_parameters_spellings_agree():
    old = parse_deepseek_config(cfg("tiny-v3"))
    params = dict(cfg("tiny-v3")["rope_scaling"])
    params.pop("type")
    params.update(rope_type="yarn", rope_theta=10000.0)
    new = parse_deepseek_config(cfg("tiny-v3", rope_scaling=..., rope_theta=..., rope_parameters=params))
    assert new.rope_theta == old.rope_theta == 10000.0
    assert new.rope_scaling == old.rope_scaling
    assert old.rope_scaling["type"] == "yarn" and old.rope_scaling["factor"] == 4.0
    plain = parse_deepseek_config(cfg("tiny-v3", rope_scaling=..., rope_theta=..., rope_parameters={
        "rope_type": "default", "rope_theta": 50000}))
    assert plain.rope_scaling is None and plain.rope_theta == 50000.0
    with pytest.raises(UnsupportedModelError, match="rope_type 'linear'"):
        parse_deepseek_config(cfg("tiny-v3", rope_scaling={"type": "linear", "factor": 2.0}))
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings"):
        parse_deepseek_config(cfg("tiny-v3", rope_scaling={"type": "yarn", "factor": 2.0}))


@pytest.mark.parametrize(
    "quant,match",
    [
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme"),
    ],
)
def test_unsupported_quantization_is_refused(quant, match):
    with pytest.raises(UnsupportedModelError, match=match):
        parse_deepseek_config(cfg("tiny-v3", quantization_config=quant))


@pytest.mark.parametrize(
    "changes,key",
    [
        ({"hidden_size": ...}, "hidden_size"),
        ({"q_lora_rank": ...}, "q_lora_rank"),
        ({"kv_lora_rank": ...}, "kv_lora_rank"),
        ({"hidden_size": "128"}, "hidden_size"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"vocab_size": -5}, "vocab_size"),
        ({"rms_norm_eps": "small"}, "rms_norm_eps"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ({"num_experts_per_tok": ...}, "num_experts_per_tok"),
        ({"n_group": 3}, "n_group"),
        ({"rope_scaling": [1, 2]}, "rope_scaling"),
        ({"eos_token_id": "eos"}, "eos_token_id"),
    ],
)
def test_malformed_config_names_the_key(changes, key):
    with pytest.raises(ModelLoadError, match=key):
        parse_deepseek_config(cfg("tiny-v3", **changes))


def test_moe_layer_freq():
    c = parse_deepseek_config(cfg("tiny-v3", moe_layer_freq=2, num_hidden_layers=5))
    assert [c.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]


def test_registry_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_config(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'llama' is not supported.*deepseek_v3"):
        model_class_for(load_hf_config(str(tmp_path)))
    with pytest.raises(ModelLoadError, match="model_type"):
        model_class_for({})
    assert model_class_for(cfg("tiny-v2")) is model_class_for(cfg("tiny-v3"))
