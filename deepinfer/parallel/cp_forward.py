"""The context-parallel step of one cp rank (docs/parallelism.md "Context-parallel prefill"), and what a
context-parallel engine refuses at start-up.

The cp ranks of a replica hold the whole model and the whole KV cache, see the same requests and schedule
the same batches (like a tensor-parallel group). Per step, `ContextParallelForward.logits_hidden`:
- a step the plan does not split (parallel/context_parallel.py: decodes, short prefills) runs whole on
  every rank, as in one process: the same inputs and ops give the same bits everywhere;
- a split step: this rank's batch (parallel/cp_batch.py) goes through the model (its attention layers
  exchange the latent KV entries, cp_attention.py; MoE and MLP see only this rank's tokens); then the
  hidden states of the rows that get logits are all-gathered over "cp" (padded to the longest rank) and put
  in the step's order, so every rank computes the same logits from the same rows and samples the same
  tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.backend import Communicator, ForwardBatch, KVCaches
from deepinfer.errors import ConfigError
from deepinfer.parallel.context_parallel import plan_context_parallel
from deepinfer.parallel.cp_batch import split_batch

# the model types whose attention layers take a ContextParallelBatch (MLA: models/layers/cp_attention.py;
# V4: models/deepseek_v4/cp_attention.py)
CP_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v4")


def context_parallel_refusals(cfg, hf_config: dict, caps=None) -> list[str]:
    """What context_parallel_size > 1 cannot run with yet, each with its reason (empty at cp = 1).

    caps: the backend's BackendCaps (its largest job; the engine's check_backend refuses first, this names
    the context-parallel reason)."""
    cp = cfg.context_parallel_size
    if cp <= 1:
        return []
    me = f"EngineConfig.context_parallel_size={cp}"  # the CLI names the flags (cli_args.name_flags)
    reasons = []
    if cfg.tensor_parallel_size > 1:
        reasons.append(f"{me} with EngineConfig.tensor_parallel_size={cfg.tensor_parallel_size}: the split step's "
                       "attention runs whole heads on each cp rank; cp x tp layouts are not built")
    if cfg.data_parallel_size > 1:
        reasons.append(f"{me} with EngineConfig.data_parallel_size={cfg.data_parallel_size}: the leader's replica "
                       "reports and the dummy forwards do not know cp ranks yet")
    if cfg.enable_expert_parallel:
        reasons.append(f"{me} with EngineConfig.enable_expert_parallel: in a split step each cp rank's MoE layer "
                       "sees other tokens; the expert-parallel dispatch over cp ranks is not built")
    if cfg.spec_method():
        reasons.append(f"{me} with speculative decoding: the verification step is not split")
    if cfg.kv_cache_storage() != "auto":
        reasons.append(f"{me} with EngineConfig.kv_cache_dtype={cfg.kv_cache_dtype!r}: the MLA op quantizes the "
                       "cache with its own per-layer scale; the other ranks' entries are written outside it")
    model_type = hf_config.get("model_type")
    if model_type not in CP_MODEL_TYPES:
        reasons.append(f"{me} with model_type {model_type!r}: only {', '.join(CP_MODEL_TYPES)} split a prefill "
                       "(their attention layers take a split step)")
    world = cfg.parallel_layout().world_size
    if caps is not None and caps.max_tensor_parallel_size < world:
        reasons.append(f"{me} needs {world} ranks; this backend allows {caps.max_tensor_parallel_size} (it has not "
                       "run with several devices)")
    return reasons


class ContextParallelForward:
    """One cp rank's forward of every step (module docstring). num_split_steps counts the steps it split."""

    def __init__(self, model, comm: Communicator, min_prefill_tokens: int):
        if not getattr(model, "supports_context_parallel", False):
            raise ConfigError(f"context parallel: {type(model).__name__} does not split a prefill "
                              f"(model types that do: {', '.join(CP_MODEL_TYPES)})")
        reasons = model.context_parallel_reasons() if hasattr(model, "context_parallel_reasons") else []
        if reasons:  # what only the loaded model on its backend can tell (V4: its attention op's layout)
            raise ConfigError("context parallel: " + "; ".join(reasons))
        self.model = model
        self.comm = comm
        self.min_prefill_tokens = min_prefill_tokens
        self.num_split_steps = 0

    def logits_hidden(self, batch: ForwardBatch, caches: KVCaches,
                      forward: Callable[[ForwardBatch], torch.Tensor] | None = None) -> torch.Tensor | None:
        """The final hidden states of batch.logits_indices' rows, in that order ([N, hidden]; None when no row
        gets logits); the step's KV written on this rank either way. forward: how a step that is not split
        runs (the model runner's, which may replay a graph); default the model's forward."""
        plan = plan_context_parallel(batch.query_lens_cpu, self.comm.world_size, self.min_prefill_tokens)
        if plan is None:
            hidden = forward(batch) if forward is not None else self.model.forward(batch, caches)
            return hidden[batch.logits_indices] if batch.logits_indices.numel() else None
        self.num_split_steps += 1
        step = split_batch(batch, plan, self.comm)
        hidden = self.model.forward(step.batch, caches)
        if step.pick.numel() == 0:
            return None
        rows = hidden[step.batch.logits_indices]
        width = max(step.logits_counts)
        if rows.shape[0] < width:
            rows = torch.cat([rows, rows.new_zeros((width - rows.shape[0], rows.shape[1]))])
        return self.comm.all_gather(rows.contiguous(), dim=0).index_select(0, step.pick)
