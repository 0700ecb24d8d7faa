"""Speculative decoding's settings, refusals and KV rollback: every bad value or combination that cannot
run is an error naming the field / flag / variable, never a silent fallback."""

from __future__ import annotations

import argparse

import pytest
import torch

import deepinfer
from deepinfer import EngineConfig, SamplingParams
from deepinfer.backend import KVCacheSpec
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.engine import DeepInferenceEngine
from deepinfer.entrypoints.cli_args import add_engine_args, engine_config_from_args
from deepinfer.errors import ConfigError, DeepInferError
from deepinfer.kv.manager import KVCacheManager
from deepinfer.models.registry import load_model
from deepinfer.sched.request import Request, Sequence
from deepinfer.text.tokenizer import Tokenizer


def test_fields_validate_and_name_themselves():
    with pytest.raises(ConfigError, match="EngineConfig.speculative_method"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ConfigError, match="EngineConfig.num_speculative_tokens"):
        EngineConfig(speculative_method="mtp", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="EngineConfig.num_speculative_tokens .*needs speculative_method"):
        EngineConfig(num_speculative_tokens=3)
    with pytest.raises(ConfigError, match="EngineConfig.speculative_adaptive"):
        EngineConfig(speculative_method="mtp", speculative_adaptive="yes")
    with pytest.raises(ConfigError, match="use_nextn_decode=2 .*num_speculative_tokens=3 disagree"):
        EngineConfig(use_nextn_decode=2, num_speculative_tokens=3)
    cfg = EngineConfig(speculative_method="mtp")
    assert (cfg.spec_method(), cfg.spec_num_tokens()) == ("mtp", 5)
    assert (EngineConfig().spec_method(), EngineConfig().spec_num_tokens()) == (None, 0)


def test_environment_turns_it_on():
    cfg = EngineConfig().with_env({"DEEPINFER_ENABLE_MTP_VARLEN": "1"})
    assert (cfg.spec_method(), cfg.spec_num_tokens()) == ("mtp", 5)
    cfg = EngineConfig().with_env({"DEEPINFER_USE_NEXTN_DECODE": "2"})
    assert (cfg.spec_method(), cfg.spec_num_tokens()) == ("mtp", 2)


def test_cli_flags_map_onto_the_fields():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-method", "mtp", "--num-speculative-tokens", "3", "--speculative-adaptive"])
    cfg = engine_config_from_args(args)
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.speculative_adaptive) == ("mtp", 3, True)


@pytest.fixture(scope="module")
def parts():
    path = deepinfer.embedded_model_path()
    backend = CPUBackend()
    return path, backend, load_model(path, backend, torch.float32, progress=False, load_mtp=True)


def _engine(parts, **kw):
    path, backend, model = parts
    cfg = EngineConfig(model_name_or_path=path, device="cpu", max_model_len=256, num_kv_blocks=64, load_progress=False,
                       speculative_method="mtp", **kw)
    return DeepInferenceEngine.from_components(cfg, model, Tokenizer.from_pretrained(path), backend)


def test_async_scheduling_is_refused_naming_the_flag(parts):
    with pytest.raises(ConfigError, match=r"speculative_method='mtp'.*async_scheduling=True \(--async-scheduling"):
        _engine(parts, async_scheduling=True)


def test_a_model_built_without_mtp_is_refused(parts):
    path, backend, _ = parts
    plain = load_model(path, backend, torch.float32, progress=False)
    cfg = EngineConfig(model_name_or_path=path, device="cpu", num_kv_blocks=64, speculative_method="mtp")
    with pytest.raises(ConfigError, match="no MTP module"):
        DeepInferenceEngine.from_components(cfg, plain, Tokenizer.from_pretrained(path), backend)


def test_kv_rollback_returns_blocks_past_the_kept_tokens():
    spec = KVCacheSpec(name="mla", layer_ids=(0,), entry_shape=(4,), dtype=torch.float32)
    kv = KVCacheManager([spec], {"mla": 8}, 4, 2, 64, prefix_caching=True)

    req = Request(request_id="r", prompt=None, prompt_token_ids=list(range(9)), params=SamplingParams())
    s = Sequence(seq_id="s", request=req, index=0, seed=0)
    kv.allocate(s, 9)  # 3 blocks
    s.num_computed_tokens = 9
    kv.allocate(s, 6)  # a verify step: 6 more tokens -> 4 blocks
    assert kv.num_blocks_used == 4
    kv.take_table_changes()
    kv.rollback(s, 10)  # 1 accepted: 10 tokens -> 3 blocks
    assert kv.num_blocks_used == 3 and kv.block_table("s", "mla")[3:] == []
    assert kv.take_table_changes() == {"mla": [(0, 3, 4)]}
    assert kv.try_extend(s, 1) and not kv.try_extend(s, 4)  # the room shrank with the tables
    kv.register_computed(s)  # keys the 2 full blocks of the 9 known tokens
    with pytest.raises(DeepInferError, match="keyed in the prefix cache"):
        kv.rollback(s, 7)
