"""Prometheus metrics for /metrics (prometheus-client, one registry per app).

Latency histograms are observed on the engine loop thread as outputs arrive;
engine gauges and token counters are read from the loop's latest stats
snapshot at scrape time, so scraping never touches the engine itself.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector:
    """Exposes the engine's stats snapshot (running / waiting, KV usage, token totals)."""

    def __init__(self, get_async_engine):
        self._get = get_async_engine

    def collect(self):
        aengine = self._get()
        stats = aengine.snapshot.stats if aengine is not None else None
        if stats is None:
            return
        gauges = [
            ("deepinfer_num_requests_running", "requests being decoded or prefilled", stats.num_running),
            ("deepinfer_num_requests_waiting", "requests queued for scheduling", stats.num_waiting),
            ("deepinfer_kv_cache_usage_ratio", "fraction of KV blocks in use (0-1)", stats.kv_usage),
            ("deepinfer_kv_blocks_used", "KV blocks in use", stats.kv_blocks_used),
            ("deepinfer_kv_blocks_total", "KV blocks in the pool", stats.kv_blocks_total),
            ("deepinfer_kv_capacity_tokens", "tokens the KV pool holds", stats.kv_capacity_tokens),
            ("deepinfer_requests_in_flight", "requests the server is streaming", aengine.num_in_flight),
            ("deepinfer_prefix_cache_blocks", "KV blocks keyed in the prefix cache (held or evictable)",
             stats.prefix_cache_blocks),
            ("deepinfer_prefix_cache_hit_rate", "prefix cache hit tokens / queried tokens, since start (0-1)",
             stats.prefix_cache_hit_tokens / stats.prefix_cache_queried_tokens
             if stats.prefix_cache_queried_tokens else 0.0),
        ]
        if stats.spec_method is not None and stats.spec_steps:  # speculative decoding (docs/speculative.md)
            gauges += [
                ("deepinfer_spec_mean_accepted_length", "tau: tokens emitted per decoding sequence-step, since start",
                 stats.spec_tau),
                ("deepinfer_spec_acceptance_rate", "accepted / verified drafted tokens, since start (0-1)",
                 stats.spec_acceptance_rate if stats.spec_drafted_tokens else 0.0),
                ("deepinfer_spec_verified_per_step", "drafted tokens verified per step (last 1024 steps)",
                 stats.spec_mean_budget),
            ]
            if stats.spec_mean_chain == stats.spec_mean_chain:  # not NaN: MTP drafting (n-gram makes no chains)
                gauges.append(("deepinfer_spec_mean_chain_length",
                               "MTP drafts per chain and drafting step (last 1024 steps)", stats.spec_mean_chain))
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        if stats.spec_method is not None and stats.spec_steps and stats.spec_conditional_acceptance:
            g = GaugeMetricFamily("deepinfer_spec_conditional_acceptance",
                                  "per draft slot: P(accepted | earlier slots accepted), since start (0-1)",
                                  labels=["slot"])
            for j, rate in enumerate(stats.spec_conditional_acceptance):
                if rate == rate:  # a slot never reached has no rate (NaN): not exported
                    g.add_metric([str(j + 1)], float(rate))
            yield g
        counters = [
            ("deepinfer_prompt_tokens", "prompt tokens processed", stats.prompt_tokens_total),
            ("deepinfer_generation_tokens", "tokens generated", stats.generation_tokens_total),
            ("deepinfer_num_preemptions", "requests preempted for KV space", stats.num_preemptions),
            ("deepinfer_prefix_cache_queries", "tokens looked up in the prefix cache at admission",
             stats.prefix_cache_queried_tokens),
            ("deepinfer_prefix_cache_hits", "tokens served from the prefix cache at admission",
             stats.prefix_cache_hit_tokens),
        ]
        if stats.spec_method is not None:  # speculative steps by how they ran (spec/overlap.py, spec/chained_steps.py)
            counters += [
                ("deepinfer_spec_overlapped_steps", "speculative steps whose read-back was the next engine call's",
                 stats.spec_overlapped_steps),
                ("deepinfer_spec_chained_steps", "of those, steps launched on the device results of the one before "
                 "(async scheduling)", stats.spec_chained_steps),
            ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c


class ServerMetrics:
    """All metrics of one server; `render()` is the /metrics body."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_responses = Counter(
            "deepinfer_http_responses", "HTTP responses by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.requests_finished = Counter(
            "deepinfer_requests_finished", "engine requests finished, by reason", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "deepinfer_inter_token_latency_seconds", "time between output steps", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "deepinfer_e2e_request_latency_seconds", "request latency in the engine", buckets=_E2E_BUCKETS, registry=r
        )
        self._async_engine = None
        r.register(_EngineCollector(lambda: self._async_engine))

    def attach(self, async_engine) -> None:
        self._async_engine = async_engine

    # called on the engine loop thread
    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finished(self, reason: str | None, tracked, now: float) -> None:
        self.requests_finished.labels(finish_reason=str(reason)).inc()
        self.e2e.observe(now - tracked.arrival)

    # called by the HTTP middleware
    def on_response(self, endpoint: str, status: int) -> None:
        self.http_responses.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
