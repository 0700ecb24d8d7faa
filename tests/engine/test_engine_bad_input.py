"""Bad input at every layer: config, environment, device, checkpoint, prompt, sampling values.
Each gives a deepinfer exception whose message names the problem."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams
from deepinfer.errors import (
    BackendError,
    ConfigError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    UnsupportedModelError,
)

PRESET = "tiny-v2-lite"


@pytest.fixture(scope="module")
def engine(checkpoint):
    return DeepInferenceEngine.from_config(
        EngineConfig(model_name_or_path=checkpoint(PRESET), device="cpu", max_model_len=32, num_kv_blocks=16,
                     load_progress=False)
    )


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("DEEPINFER_DEVICE", "DEEPINFER_BATCH_INVARIANT", "DEEPINFER_ENABLE_MTP_VARLEN", "DEEPINFER_USE_NEXTN_DECODE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def copy_with_config(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    file = os.path.join(dst, "config.json")
    with open(file) as f:
        text = f.read()
    with open(file, "w") as f:
        f.write(edit(text))
    return str(dst)


# ---------------------------------------------------------------- config fields


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("tensor_parallel_size", 0, "tensor_parallel_size"),
        ("max_model_len", 1, "max_model_len"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
        ("dtype", "int8", "dtype"),
        ("quantization", "awq", "quantization"),
        ("max_num_seqs", 0, "max_num_seqs"),
        ("max_num_batched_tokens", -1, "max_num_batched_tokens"),
        ("block_size", 0, "block_size"),
        ("kv_cache_memory_bytes", 0, "kv_cache_memory_bytes"),
        ("enforce_eager", "yes", "enforce_eager"),
        ("use_nextn_decode", -1, "use_nextn_decode"),
    ],
)
def test_config_field_errors_name_the_field(field, value, match):
    with pytest.raises(ConfigError, match=f"EngineConfig.{match}"):
        EngineConfig(model_name_or_path="/x", **{field: value})


def test_unknown_setting_through_llm_kwargs():
    with pytest.raises(ConfigError, match="max_num_sequences"):
        DeepInferenceEngine(model="/x", max_num_sequences=3)


@pytest.mark.parametrize(
    "var,value,match",
    [
        ("DEEPINFER_BATCH_INVARIANT", "maybe", "DEEPINFER_BATCH_INVARIANT='maybe' is not a boolean"),
        ("DEEPINFER_ENABLE_MTP_VARLEN", "2", "DEEPINFER_ENABLE_MTP_VARLEN='2' is not a boolean"),
        ("DEEPINFER_USE_NEXTN_DECODE", "x", "DEEPINFER_USE_NEXTN_DECODE='x' is not an integer"),
        ("DEEPINFER_USE_NEXTN_DECODE", "-2", "DEEPINFER_USE_NEXTN_DECODE='-2' must be >= 0"),
        ("DEEPINFER_DEVICE", " ", "DEEPINFER_DEVICE is empty"),
    ],
)
def test_bad_env_values_name_the_variable(clean_env, var, value, match):
    clean_env.setenv(var, value)
    with pytest.raises(ConfigError, match=match):
        DeepInferenceEngine.from_config(EngineConfig(model_name_or_path="/does/not/matter"))


@pytest.mark.parametrize("var,value", [("DEEPINFER_USE_NEXTN_DECODE", "2"), ("DEEPINFER_ENABLE_MTP_VARLEN", "1")])
def test_speculation_on_a_model_without_mtp_fails_at_start(clean_env, checkpoint, var, value):
    """Both variables turn MTP speculation on (docs/speculative.md); the preset has no MTP module, so the
    start-up error names the setting and the reason (the embedded model runs it: tests/spec)."""
    clean_env.setenv(var, value)
    with pytest.raises(ConfigError, match=r"speculative_method='mtp'.*DEEPINFER_ENABLE_MTP_VARLEN.*no MTP module"):
        DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=checkpoint(PRESET), device="cpu"))


def test_env_maps_onto_config_explicit_fields_win(clean_env):
    clean_env.setenv("DEEPINFER_DEVICE", "cuda")
    clean_env.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    cfg = EngineConfig(model_name_or_path="/x").with_env()
    assert (cfg.device, cfg.batch_invariant, cfg.use_nextn_decode) == ("cuda", True, 3)
    assert EngineConfig(model_name_or_path="/x", device="cpu").with_env().device == "cpu"
    clean_env.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    assert EngineConfig(model_name_or_path="/x").with_env().batch_invariant is False


# ---------------------------------------------------------------- device and backend


def test_unknown_device_lists_backends(clean_env, checkpoint):
    with pytest.raises(BackendError, match=r"unknown device 'tpu'(.|\n)*cpu \(device cpu\): available"):
        DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=checkpoint(PRESET), device="tpu"))


def test_device_from_env(clean_env, checkpoint):
    clean_env.setenv("DEEPINFER_DEVICE", "nosuchdevice")
    with pytest.raises(BackendError, match="unknown device 'nosuchdevice'"):
        DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=checkpoint(PRESET)))


def test_backend_refuses_what_it_cannot_honour(clean_env, checkpoint):
    with pytest.raises(BackendError, match="= 128 devices exceeds this backend's maximum of 64"):
        DeepInferenceEngine.from_config(
            EngineConfig(model_name_or_path=checkpoint(PRESET), device="cpu", tensor_parallel_size=64,
                         data_parallel_size=2)
        )
    clean_env.setenv("DEEPINFER_BATCH_INVARIANT", "1")  # the env var reaches the backend: honoured for V2 / V3
    engine = DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=checkpoint(PRESET), device="cpu"))
    assert engine.config.batch_invariant and engine.backend.batch_invariance_enabled
    with pytest.raises(BackendError, match="batch-invariant inference covers model_type .* not 'deepseek_v4'"):
        DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=checkpoint("tiny-v4"), device="cpu",
                                                     max_num_batched_tokens=256))


def test_quantization_must_match_checkpoint(clean_env, checkpoint):
    # fp8 on a bf16 checkpoint quantizes at load (tests/quant); int4 cannot be made online
    with pytest.raises(ConfigError, match=r"EngineConfig.quantization must be None .* \(got 'int4'\)"):
        DeepInferenceEngine.from_config(
            EngineConfig(model_name_or_path=checkpoint(PRESET), device="cpu", quantization="int4")
        )


def test_max_model_len_beyond_model(clean_env, checkpoint):
    with pytest.raises(ConfigError, match="max_model_len=100000 exceeds the model's max_position_embeddings"):
        DeepInferenceEngine.from_config(
            EngineConfig(model_name_or_path=checkpoint(PRESET), device="cpu", max_model_len=100000,
                         load_progress=False)
        )


def test_kv_cache_too_small_for_one_sequence(clean_env, checkpoint):
    with pytest.raises(ConfigError, match="cannot hold one sequence of max_model_len=64"):
        DeepInferenceEngine.from_config(
            EngineConfig(model_name_or_path=checkpoint(PRESET), device="cpu", max_model_len=64, num_kv_blocks=2,
                         load_progress=False)
        )


# ---------------------------------------------------------------- checkpoint


def test_unknown_model_dir(clean_env, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=str(tmp_path / "nope"), device="cpu"))


def test_malformed_config(clean_env, checkpoint, tmp_path):
    path = copy_with_config(checkpoint(PRESET), tmp_path / "m", lambda t: t[: len(t) // 2])
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=path, device="cpu"))


def test_unknown_model_type(clean_env, checkpoint, tmp_path):
    def edit(text):
        cfg = json.loads(text)
        cfg["model_type"] = "llama"
        return json.dumps(cfg)

    path = copy_with_config(checkpoint(PRESET), tmp_path / "u", edit)
    with pytest.raises(UnsupportedModelError, match="model_type 'llama' is not supported"):
        DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=path, device="cpu"))


def test_malformed_generation_config(clean_env, checkpoint, tmp_path):
    path = copy_with_config(checkpoint(PRESET), tmp_path / "g", lambda t: t)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        f.write('{"eos_token_id": "one"}')
    with pytest.raises(ModelLoadError, match="generation_config.json: eos_token_id must be a token id"):
        DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=path, device="cpu", load_progress=False,
                                                     max_model_len=32, num_kv_blocks=4))


# ---------------------------------------------------------------- requests


def test_prompt_too_long(engine):
    with pytest.raises(PromptTooLongError, match="prompt has 40 tokens but max_model_len is 32"):
        engine.generate([[5] * 40], use_tqdm=False)
    with pytest.raises(PromptTooLongError, match="max_model_len is 32"):
        engine.generate("hello " * 40, use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=2.0), "min_p"),
        (dict(logprobs=99), "logprobs"),
        (dict(presence_penalty=5.0), "presence_penalty"),
        (dict(prompt_logprobs=1), "prompt_logprobs"),  # valid value, not built: refused, not ignored
    ],
)
def test_invalid_sampling_values(engine, kwargs, param):
    with pytest.raises(InvalidRequestError, match=param) as info:
        engine.generate(["hi"], use_tqdm=False, **kwargs)
    assert info.value.param == param


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(top_k=2**63), "top_k"),  # used to pass and raise inside the step, failing every request in flight
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1000.0), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(frequency_penalty=float("-inf")), "frequency_penalty"),
        (dict(n=1.5), "n"),
        (dict(n=10**6), "n"),
        (dict(max_tokens=2**63), "max_tokens"),
        (dict(seed=2**64), "seed"),
        (dict(stop_token_ids=[2**31]), "stop_token_ids"),
        (dict(stop_token_ids=[10**6]), "stop_token_ids"),  # valid int32, outside this model's vocabulary
    ],
)
def test_values_the_engine_cannot_represent(engine, kwargs, param):
    with pytest.raises(InvalidRequestError, match=param) as info:
        engine.generate(["hi"], use_tqdm=False, **kwargs)
    assert info.value.param == param
    assert not engine.has_unfinished_requests() and engine.stats().kv_blocks_used == 0


def test_invalid_prompts(engine):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.generate([""], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match=r"prompt token 1 has id 999999, outside the vocabulary"):
        engine.generate([[0, 999999]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt token 0 is 'a', not an integer id"):
        engine.add_request("t", ["a"], SamplingParams())
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter"):
        engine.generate(["hi"], use_tqdm=False, temprature=0.5)
    with pytest.raises(InvalidRequestError, match="got 1 SamplingParams for 2 prompts"):
        engine.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="not both"):
        engine.generate(["a"], SamplingParams(), use_tqdm=False, temperature=0.0)
    # nothing of the failed calls stayed queued
    assert not engine.has_unfinished_requests() and engine.stats().kv_blocks_used == 0
