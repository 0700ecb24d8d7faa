"""Wiring speculative decoding into an engine at start-up: the drafter, the slot policy (static k, or the
confidence scheduler with its profiled step-cost table) and the speculative step pipeline."""

from __future__ import annotations

import logging

from deepinfer.errors import ConfigError
from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.draft_slots import SlotPolicy
from deepinfer.spec.metrics import SpecMetrics
from deepinfer.spec.mtp_drafter import MTPDrafter
from deepinfer.spec.ngram import NgramDrafter
from deepinfer.spec.pipeline import SpecStepPipeline

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
    if method == "mtp":
        drafter = MTPDrafter(model, runner.caches, kv.block_tables, kv.block_size, kv.specs, backend.device)
    else:
        drafter = NgramDrafter()
    policy = SlotPolicy(k=k, max_model_len=max_model_len)
    if cfg.speculative_adaptive:
        from deepinfer.spec.cost_profile import profile_step_costs

        budget = scheduler.max_num_batched_tokens
        policy.calibrator = SurvivalCalibrator(num_slots=k)
        policy.cost = profile_step_costs(model, backend, kv.block_size, k, min(budget, 512), layouts=layouts)
        logger.info("speculative decoding: step costs %s", ", ".join(
            f"{n} tok {s * 1e3:.2f} ms" for n, s in zip(policy.cost.tokens, policy.cost.seconds)))
    logger.info("speculative decoding: %s, k=%d, %s", method, k,
                "adaptive (confidence scheduler)" if cfg.speculative_adaptive else "static")
    return SpecStepPipeline(scheduler, runner, output_processor, drafter, policy, SpecMetrics(max_slots=k), method)
