"""Expert selection for every DeepSeek MoE router.

Semantics follow Hugging Face transformers 5.24:
- softmax + greedy (V2-Lite) and softmax + group_limited_greedy (V2,
  `DeepseekV2TopkRouter`): groups scored by their max, unselected groups'
  scores set to 0.0 (as HF and DeepSeek's V2 code; softmax scores are > 0);
- sigmoid + noaux_tc (V3, `DeepseekV3TopkRouter`): selection on
  scores + e_score_correction_bias, groups scored by the sum of their top-2,
  unselected groups masked with -inf; the weights are the *unbiased* scores;
- sqrtsoftplus (V4, `DeepseekV4TopKRouter`): noaux_tc with n_group == 1;
- hash (V4, `DeepseekV4HashRouter`): ids = tid2eid[token_ids], weights are the
  scores of those experts.
Then: weights /= (sum + 1e-20) when norm_topk_prob, and *= routed_scaling_factor.
(HF's V2 router never normalises; V2 configs set norm_topk_prob false.)

Ties are broken deterministically, lowest expert (or group) index first, and
the ids of a row come out in descending order of the selection score.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.backend.specs import RouterSpec
from deepinfer.errors import BackendError

SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc", "hash")


def score(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = router_logits.float()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1, dtype=torch.float32)
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    raise BackendError(f"unknown router scoring_func {scoring_func!r} (supported: {', '.join(SCORING_FUNCS)})")


def topk_lowest_index(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row; ties go to the lowest index (stable sort)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def _group_mask(choice: torch.Tensor, spec: RouterSpec, group_score: str) -> torch.Tensor:
    """Bool [T, E]: experts inside the topk_group best groups."""
    t, e = choice.shape
    grouped = choice.view(t, spec.n_group, e // spec.n_group)
    if group_score == "max":
        gscores = grouped.max(dim=-1).values
    else:  # sum of the two best experts of the group (V3)
        gscores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    gidx = topk_lowest_index(gscores, spec.topk_group)
    gmask = torch.zeros_like(gscores, dtype=torch.bool).scatter_(1, gidx, True)
    return gmask.unsqueeze(-1).expand(t, spec.n_group, e // spec.n_group).reshape(t, e)


@functools.cache  # specs are frozen: route() runs per MoE layer per step, check each spec once
def validate_router(spec: RouterSpec) -> None:
    if spec.scoring_func not in SCORING_FUNCS:
        raise BackendError(f"unknown router scoring_func {spec.scoring_func!r} (supported: {', '.join(SCORING_FUNCS)})")
    if spec.topk_method not in TOPK_METHODS:
        raise BackendError(f"unknown router topk_method {spec.topk_method!r} (supported: {', '.join(TOPK_METHODS)})")
    if not 0 < spec.top_k <= spec.num_experts:
        raise BackendError(f"router top_k={spec.top_k} must be in [1, num_experts={spec.num_experts}]")
    if spec.topk_method in ("group_limited_greedy", "noaux_tc"):
        if spec.n_group < 1 or spec.num_experts % spec.n_group:
            raise BackendError(f"router n_group={spec.n_group} does not divide num_experts={spec.num_experts}")
        if not 0 < spec.topk_group <= spec.n_group:
            raise BackendError(f"router topk_group={spec.topk_group} must be in [1, n_group={spec.n_group}]")
        if spec.topk_group * (spec.num_experts // spec.n_group) < spec.top_k:
            raise BackendError(
                f"router top_k={spec.top_k} exceeds the experts of {spec.topk_group} selected groups"
            )
        if spec.topk_method == "noaux_tc" and spec.n_group > 1 and spec.num_experts // spec.n_group < 2:
            raise BackendError("noaux_tc group scoring needs at least 2 experts per group")


def route(
    router_logits: torch.Tensor,
    spec: RouterSpec,
    correction_bias: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    score_fn=score,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32, scaling applied; topk_ids [T, k] int64).

    score_fn(router_logits, scoring_func): the scores; a backend may pass its own (e.g. the cpu
    backend's batch-invariant one) and keep this selection logic."""
    validate_router(spec)
    if router_logits.dim() != 2 or router_logits.shape[1] != spec.num_experts:
        raise BackendError(
            f"route: router_logits {tuple(router_logits.shape)} is not [T, num_experts={spec.num_experts}]"
        )
    scores = score_fn(router_logits, spec.scoring_func)
    method = spec.topk_method
    if method == "hash":
        if token_ids is None or tid2eid is None:
            raise BackendError("hash routing needs token_ids and the tid2eid table")
        if tid2eid.shape[-1] != spec.top_k:
            raise BackendError(f"tid2eid has {tid2eid.shape[-1]} experts per token, router top_k is {spec.top_k}")
        ids = tid2eid[token_ids.to(torch.long)].to(torch.long)
    elif method == "greedy":
        ids = topk_lowest_index(scores, spec.top_k)
    elif method == "group_limited_greedy":
        choice = scores
        if spec.n_group > 1:
            choice = scores.masked_fill(~_group_mask(scores, spec, "max"), 0.0)
        ids = topk_lowest_index(choice, spec.top_k)
    else:  # noaux_tc
        if correction_bias is None:
            raise BackendError("noaux_tc routing needs e_score_correction_bias (got None)")
        choice = scores + correction_bias.float()
        if spec.n_group > 1:
            choice = choice.masked_fill(~_group_mask(choice, spec, "top2sum"), float("-inf"))
        ids = topk_lowest_index(choice, spec.top_k)
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * spec.routed_scaling_factor
    return weights, ids
