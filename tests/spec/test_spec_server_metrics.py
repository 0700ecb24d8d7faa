"""Speculation's gauges on /metrics (entrypoints/openai/metrics.py) from an engine's stats, parsed back with
prometheus-client's own text parser: tau, acceptance, verified drafts per step, mean chain length and the
per-slot conditional acceptance (a slot never reached is not exported)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.engine.stats import EngineStats
from deepinfer.entrypoints.openai.metrics import ServerMetrics

BASE = dict(num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=8, kv_usage=0.0, kv_capacity_tokens=128,
            prompt_tokens_total=0, generation_tokens_total=0, num_preemptions=0)


def stats_of(**kw) -> EngineStats:
    return EngineStats(**BASE, **kw)


def scrape(stats: EngineStats) -> dict:
    m = ServerMetrics()
    m.attach(SimpleNamespace(snapshot=SimpleNamespace(stats=stats), num_in_flight=0))
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for sample in fam.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_speculation_gauges_and_per_slot_acceptance():
    stats = stats_of(spec_method="mtp", spec_steps=10, spec_request_steps=20, spec_drafted_tokens=30,
                     spec_accepted_tokens=18, spec_tau=1.9, spec_acceptance_rate=0.6,
                     spec_conditional_acceptance=(0.8, 0.5, float("nan")), spec_mean_budget=3.0, spec_mean_chain=1.5,
                     spec_overlapped_steps=9, spec_chained_steps=7)
    got = scrape(stats)
    assert got[("deepinfer_spec_overlapped_steps_total", ())] == 9 and got[("deepinfer_spec_chained_steps_total", ())] == 7
    assert got[("deepinfer_spec_mean_accepted_length", ())] == pytest.approx(1.9)
    assert got[("deepinfer_spec_acceptance_rate", ())] == pytest.approx(0.6)
    assert got[("deepinfer_spec_verified_per_step", ())] == pytest.approx(3.0)
    assert got[("deepinfer_spec_mean_chain_length", ())] == pytest.approx(1.5)
    slots = {dict(k[1])["slot"]: v for k, v in got.items() if k[0] == "deepinfer_spec_conditional_acceptance"}
    assert slots == {"1": pytest.approx(0.8), "2": pytest.approx(0.5)}


def test_ngram_has_no_chain_gauge_and_speculation_off_has_none():
    ngram = scrape(stats_of(spec_method="ngram", spec_steps=4, spec_tau=1.2, spec_conditional_acceptance=(0.3,),
                            spec_mean_budget=1.0))
    assert ("deepinfer_spec_mean_accepted_length", ()) in ngram
    assert not any(k[0] == "deepinfer_spec_mean_chain_length" for k in ngram)
    off = scrape(stats_of())
    assert not any(k[0].startswith("deepinfer_spec") for k in off)
