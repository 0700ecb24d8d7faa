"""Wiring speculative decoding into an engine at start-up: the drafter, the slot policy (static k, or the
confidence scheduler with its profiled step-cost table) and the speculative step pipeline."""

from __future__ import annotations

import logging

from deepinfer.backend import DecodeGraphRunner, MTPGraphRunner
from deepinfer.errors import ConfigError
from deepinfer.spec.async_pauses import AsyncPauses, use_async_pauses
from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.shared_times import SharedTimes
from deepinfer.spec.slot_policy import SlotPolicy
from deepinfer.spec.metrics import SpecMetrics
from deepinfer.spec.mtp_drafter import MTPDrafter
from deepinfer.spec.ngram import NgramDrafter
from deepinfer.spec.pipeline import SpecStepPipeline
from deepinfer.spec.verify_batch import graph_rows

logger = logging.getLogger("deepinfer")


def build_spec_pipeline(cfg, model, backend, scheduler, runner, output_processor, layouts,
                        max_model_len: int) -> SpecStepPipeline:
    """cfg: the EngineConfig (speculation on); the model must have been built with load_mtp=True."""
    method = cfg.spec_method()
    if method == "mtp" and not len(getattr(model, "mtp", ()) or ()):
        raise ConfigError(f"EngineConfig.speculative_method={cfg.spec_method()!r}: the model was built without its "
                          "MTP modules (load_model(..., load_mtp=True))")
    k = cfg.spec_num_tokens()
    kv = scheduler.kv
    async_pauses = use_async_pauses(cfg, backend, kv, method)  # before the profiling: a refusal comes at once
    if runner.graph_runner is not None:
        capture_verify_graphs(cfg, backend, runner, k, scheduler.max_num_batched_tokens, max_model_len)
    if method == "mtp":
        drafter = MTPDrafter(model, runner.caches, kv.block_tables, kv.block_size, kv.specs, backend.device,
                             graphs=capture_mtp_graphs(cfg, backend, runner, kv, k), pick_op=backend.draft_pick,
                             snapshot_kv=kv if kv.uses_state else None)
    else:
        drafter = NgramDrafter()
    policy = SlotPolicy(k=k, max_model_len=max_model_len)
    # the cpu MLA op batches decode rows and takes a multi-token row through a per-request prefill: verify rows as
    # decode rows compute the same (causal by construction) and measured 0-45% faster there (docs/speculative.md).
    # The step-cost table is profiled in the same form, or it would price a verify step the engine never runs.
    decode_rows_eager = backend.name == "cpu" and not kv.uses_state  # (V4: state rows are per request)
    if cfg.speculative_adaptive:
        from deepinfer.spec.cost_profile import profile_step_costs

        budget = scheduler.max_num_batched_tokens
        policy.calibrator = SurvivalCalibrator(num_slots=k)
        policy.cost, policy.cost_shapes = profile_step_costs(
            model, backend, kv.block_size, k, min(budget, 512), layouts=layouts, graph_runner=runner.graph_runner,
            group_names=[s.name for s in kv.specs], decode_rows=decode_rows_eager)
        if method == "mtp":
            from deepinfer.spec.draft_cost import profile_draft_costs

            policy.draft_cost = profile_draft_costs(model, backend, kv.block_size, k, min(cfg.max_num_seqs, 128),
                                                    layouts=layouts, drafter=drafter)
            table = policy.draft_cost
            logger.info("speculative decoding: MTP drafting costs (chain 1 / %d) %s", k, ", ".join(
                f"{n} seqs {a * 1e3:.2f} / {b * 1e3:.2f} ms ({shape})"
                for n, a, b, shape in zip(table.counts, table.one.seconds, table.full.seconds, table.shapes)))
        logger.info("speculative decoding: step costs %s", ", ".join(
            f"{n} tok {s * 1e3:.2f} ms ({shape})"
            for n, s, shape in zip(policy.cost.tokens, policy.cost.seconds, policy.cost_shapes)))
    times = SharedTimes.for_backend(backend) if cfg.speculative_adaptive else SharedTimes()
    if policy.cost is not None:  # tp rank 0's profiles on every rank (spec/shared_times.py)
        policy.cost.seconds = times.agree(policy.cost.seconds)
    if policy.draft_cost is not None:
        policy.draft_cost.one.seconds = times.agree(policy.draft_cost.one.seconds)
        policy.draft_cost.full.seconds = times.agree(policy.draft_cost.full.seconds)
    logger.info("speculative decoding: %s, k=%d, %s", method, k,
                "adaptive (confidence scheduler)" if cfg.speculative_adaptive else "static")
    pipeline = SpecStepPipeline(scheduler, runner, output_processor, drafter, policy, SpecMetrics(max_slots=k), method)
    pipeline.times = times
    pipeline.shapes.decode_rows_eager = decode_rows_eager
    if cfg.async_scheduling:  # (check_speculation refused what cannot chain; the graphs must have come too)
        if not pipeline.overlap:
            raise ConfigError("async_scheduling=True (--async-scheduling / DEEPINFER_ASYNC_SCHEDULING=1) with "
                              "speculative decoding: no MTP graphs were captured, so no step runs one-sync; leave it "
                              "unset or off")
        pipeline.chaining = True
        logger.info("speculative decoding: async scheduling: a one-sync step is launched on the device results of the "
                    "one in flight where it can be (spec/chained_steps.py)")
    if async_pauses:
        pipeline.async_pauses = AsyncPauses(pipeline)
        logger.info("speculative decoding: the plain steps of adaptive pauses run through async scheduling "
                    "(spec/async_pauses.py); speculative steps run sync")
    return pipeline


def capture_mtp_graphs(cfg, backend, runner, kv, k: int) -> MTPGraphRunner | None:
    """The MTP drafter's graphs (backend/mtp_graph_runner.py), over the engine's decode-graph runner's graph API
    and buckets, when it has one (a backend that captures graphs and enforce_eager off); else None (eager). Their
    decode rows' inputs come from the backend's decode_rows_meta op. None too for a model with per-sequence state
    (V4): its decode graphs are off (no padding-safe state row), and so are the MTP module's."""
    api = runner.graph_runner
    if not isinstance(api, DecodeGraphRunner) or kv.uses_state:
        return None
    graphs = MTPGraphRunner.capture(api, runner.model, runner.caches, runner.builder.mirror,
                                    {s.name: s.tokens_per_entry for s in kv.specs}, kv.block_size, cfg.max_num_seqs,
                                    k, runner.device, meta_op=backend.decode_rows_meta,
                                    pick_op=backend.draft_pick)
    if graphs is not None:
        logger.info("speculative decoding: MTP pass graphs for %s rows, chain graphs for %s drafting sequences",
                    graphs.pass_buckets, graphs.chain_buckets)
    return graphs


def capture_verify_graphs(cfg, backend, runner, k: int, token_budget: int, max_model_len: int) -> None:
    """Recapture the engine's decode graphs for max_num_seqs * (1 + k) rows (capped by the token budget), so a
    verify step of every sequence with k drafts replays one as decode rows (spec/verify_batch.py).

    The engine captures them for that many rows already (llm_engine: one capture); an engine that captured
    fewer (a runner built another way) has its graphs dropped first (their memory pool goes back before the
    larger capture). Cost: the backend's default buckets up to
    the new row count (nvidia: 1, 2, 4, 8, then every 16), one graph each, sharing one pool sized by the
    largest bucket's activations; docs/speculative.md."""
    rows = graph_rows(cfg.max_num_seqs, k, token_budget)
    if rows <= max(cfg.max_num_seqs, getattr(runner, "graph_rows", 0)):
        return
    runner.graph_runner = None
    runner.capture_decode_graphs(backend, max_model_len, rows, cfg.enforce_eager)
    logger.info("speculative decoding: decode graphs captured for up to %d rows (max_num_seqs %d x (1 + k=%d), "
                "token budget %d): verify steps replay them as decode rows", rows, cfg.max_num_seqs, k, token_budget)
