"""Lossless acceptance of drafted tokens, vectorised over a batch of variable-length drafts.

Greedy (temperature 0): accept drafted token j while it equals the target's argmax at j, then emit
the target's argmax at the first disagreement (or after the last draft: the bonus token).

Sampled (T > 0), the rejection rule of Leviathan et al. / Chen et al.: drafted token x at slot j is
accepted with probability min(1, p_j(x) / q_j(x)); on the first rejection the emitted token is drawn
from norm(max(0, p_j - q_j)); after k accepts a bonus token is drawn from p_k. Every emitted token is
then distributed exactly as p (given the prefix). q = None means the drafter is deterministic (a
one-hot q at its token, as MTP / n-gram greedy drafts are): then the rule is "accept with p(x), else
draw from p with x removed".

Noise: uniforms from the sampler's counter-based RNG (sample/rng.py) keyed by (seed, position,
stream), as the sampler keys its Gumbel draw by (seed, position): a seeded request draws the same
tokens alone or in any batch. The streams are distinct so the acceptance test of a position never
shares noise with the draw that replaces a rejected token (or with the drafter's own draw).

Draws from a distribution use inverse-CDF sampling in fixed point: an exact int64 cumulative sum of
the probabilities scaled by 2^40, so the pick does not depend on how a device groups a float scan
(batch invariance), and one uniform per row (no vocabulary-wide noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.sample.rng import GOLDEN_GAMMA, _signed, mix64, mix64_tensor, uniform_tensor

STREAM_ACCEPT = 1  # the acceptance uniform of a drafted slot
STREAM_RESAMPLE = 2  # the draw of the emitted token (residual after a rejection, or the bonus)
STREAM_DRAFT = 3  # a drafter's own draw (random drafts)

_FIXED_SCALE = float(1 << 40)  # probability -> int64 fixed point; V * 2^40 < 2^63 for V < 2^23


def spec_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """int64 stream keys for (seed, position, stream); stream 0 is exactly rng.row_key(seed, position)
    (the sampler's key), computed on the device in wrapping int64 arithmetic."""
    base = mix64_tensor(mix64_tensor(seeds.to(torch.int64) + _signed(GOLDEN_GAMMA)) ^ positions.to(torch.int64))
    if stream == 0:
        return base
    return mix64_tensor(base ^ _signed(mix64(stream + GOLDEN_GAMMA)))


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """fp64 uniforms in (0, 1), one per (seed, position) pair of the broadcast shapes."""
    s, p = torch.broadcast_tensors(seeds.to(torch.int64), positions.to(torch.int64))
    keys = spec_keys(s.reshape(-1), p.reshape(-1), stream)
    return uniform_tensor(keys, 1).view(s.shape)


@dataclass
class Verdict:
    """Per request: how many drafted tokens were accepted, and the emitted tokens (accepted drafts, then
    the target's token): row b emits tokens[b, : num_accepted[b] + 1]."""

    num_accepted: torch.Tensor  # int64 [B]
    tokens: torch.Tensor  # int64 [B, K + 1]


def _accept_prefix(accept: torch.Tensor, draft_lens: torch.Tensor | None) -> torch.Tensor:
    """int64 [B]: leading True run of accept [B, K], capped at each row's draft length (None: every row holds K)."""
    if draft_lens is not None:
        k = accept.shape[1]
        accept = accept & (torch.arange(k, device=accept.device).unsqueeze(0) < draft_lens.unsqueeze(1))
    return accept.cumprod(dim=1, dtype=torch.int64).sum(dim=1)


def greedy_accepted(target_argmax: torch.Tensor, draft: torch.Tensor, draft_lens: torch.Tensor | None) -> torch.Tensor:
    """int64 [B]: the greedy rule's accepted drafts per row (target_argmax [B, K+1], draft [B, K], draft_lens [B] or
    None when every row holds K drafts). Row b emits target_argmax[b, : num[b] + 1]: its accepted drafts equal the
    target's tokens there, so the one-sync step (spec/one_sync.py) reads its emitted tokens from the draw itself."""
    k1 = target_argmax.shape[1]
    return _accept_prefix(target_argmax[:, : k1 - 1] == draft, draft_lens)


def greedy_verify(target_argmax: torch.Tensor, draft: torch.Tensor, draft_lens: torch.Tensor | None) -> Verdict:
    """target_argmax [B, K+1], draft [B, K] (entries past draft_lens ignored), draft_lens [B] (None: all K)."""
    b = target_argmax.shape[0]
    num = greedy_accepted(target_argmax, draft, draft_lens)
    tokens = torch.cat([draft, draft.new_zeros(b, 1)], dim=1)
    tokens.scatter_(1, num.unsqueeze(1), target_argmax.gather(1, num.unsqueeze(1)))
    return Verdict(num, tokens)


def draw_from_rows(weights: torch.Tensor, combo: torch.Tensor, u: torch.Tensor, max_rows: int = 1024) -> torch.Tensor:
    """int64 [N]: for each draw i an index drawn from weights[combo[i]] / its sum (weights [U, V] >= 0, each
    <= 1) by the exact fixed-point inverse CDF with uniform u[i]. Each distinct row's cumulative sum is
    built once (rows of a batch that share a distribution share it), then one flat searchsorted: row r's
    sums are offset by the totals of the rows before it so the rows never overlap."""
    n_rows, vocab = weights.shape
    out = torch.empty(combo.shape[0], dtype=torch.int64, device=weights.device)
    for a in range(0, n_rows, max_rows):
        w = weights[a : a + max_rows]
        fixed = (w.to(torch.float64).clamp(min=0.0) * _FIXED_SCALE).floor().to(torch.int64)
        cum = fixed.cumsum(dim=-1)
        total = cum[:, -1]
        offset = total.cumsum(0) - total
        flat = (cum + offset.unsqueeze(1)).reshape(-1)
        sel = (combo >= a) & (combo < a + w.shape[0])
        r = combo[sel] - a
        t = (u[sel].to(torch.float64) * total[r].to(torch.float64)).floor().to(torch.int64)
        t = torch.minimum(t, total[r] - 1).clamp(min=0) + offset[r]
        idx = torch.searchsorted(flat, t, right=True)
        out[sel] = (idx - r * vocab).clamp(0, vocab - 1)
    return out


def rejection_verify(p: torch.Tensor, draft: torch.Tensor, draft_lens: torch.Tensor, seeds: torch.Tensor,
                     positions: torch.Tensor, q: torch.Tensor | None = None, p_rows: torch.Tensor | None = None,
                     q_rows: torch.Tensor | None = None) -> Verdict:
    """Rejection sampling of B drafts of up to K tokens.

    p: the target's distributions (after temperature / top-k / top-p): [B, K+1, V], or [P, V] rows
    indexed by p_rows [B, K+1]. q: the draft distributions the drafts were drawn from, [B, K, V] or
    [Q, V] indexed by q_rows [B, K]; None for deterministic drafts. draft [B, K] drafted ids (entries
    past draft_lens [B] ignored); seeds [B] the requests' seeds; positions [B] the position of each
    row's first drafted token. Rows that share a distribution row share its cumulative sums."""
    b, k = draft.shape
    dev = draft.device
    if p_rows is None:
        p_rows = torch.arange(b * (k + 1), device=dev).view(b, k + 1)
        p = p.reshape(b * (k + 1), -1)
    if q is not None and q_rows is None:
        q_rows = torch.arange(b * k, device=dev).view(b, k)
        q = q.reshape(b * k, -1)
    vocab = p.shape[1]
    slot = torch.arange(k, device=dev)
    pos = positions.to(torch.int64).unsqueeze(1) + slot.unsqueeze(0)  # [B, K]
    seeds = seeds.to(torch.int64)
    if k:
        p_x = p[p_rows[:, :k], draft].to(torch.float64)
        q_x = torch.ones_like(p_x) if q is None else q[q_rows, draft].to(torch.float64)
        u = uniforms(seeds.unsqueeze(1), pos, STREAM_ACCEPT)
        accept = u * q_x < p_x  # u < p/q without the division (q_x > 0 for a token the drafter drew)
        num = _accept_prefix(accept, draft_lens)
    else:
        num = torch.zeros(b, dtype=torch.int64, device=dev)
    rows = torch.arange(b, device=dev)
    pr = p_rows[rows, num]
    rejected = num < draft_lens
    at = num.clamp(max=max(k - 1, 0))
    if k == 0:
        other = torch.full_like(pr, -1)
    elif q is None:
        other = torch.where(rejected, draft[rows, at], torch.full_like(pr, -1))
    else:
        other = torch.where(rejected, q_rows[rows, at], torch.full_like(pr, -1))
    # distinct (target row, what is removed from it) combinations, each built once
    key = pr * (vocab + 1 if q is None else q.shape[0] + 1) + (other + 1)
    uniq, combo = torch.unique(key, return_inverse=True)
    u_pr = uniq // (vocab + 1 if q is None else q.shape[0] + 1)
    u_other = uniq % (vocab + 1 if q is None else q.shape[0] + 1) - 1
    weights = p[u_pr].to(torch.float64)
    has = u_other >= 0
    if bool(has.any()):
        if q is None:
            weights[has] = weights[has].scatter(1, u_other[has].unsqueeze(1), 0.0)
        else:
            weights[has] = (weights[has] - q[u_other[has]].to(torch.float64)).clamp(min=0.0)
    u_out = uniforms(seeds, positions.to(torch.int64) + num, STREAM_RESAMPLE)
    last = draw_from_rows(weights, combo, u_out)
    tokens = torch.cat([draft, draft.new_zeros(b, 1)], dim=1)
    tokens.scatter_(1, num.unsqueeze(1), last.unsqueeze(1))
    return Verdict(num, tokens)
