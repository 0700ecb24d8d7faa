"""DeepSeek-V4 lightning indexer: which compressed entries each CSA query attends to.

score(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * d_I^-0.5, over the causal
entries s < (t + 1) // m only; the top `index_topk` of them are kept. Ties
(common: ReLU makes exact zeros) are broken by the lowest entry index, so
the choice never depends on how many later entries exist.
"""

from __future__ import annotations

import torch


def indexer_scores(
    q: torch.Tensor,  # [L, Hi, Di] (RoPE applied)
    keys: torch.Tensor,  # [E, Di] indexer entries
    weights: torch.Tensor,  # [L, Hi], already scaled by Hi^-0.5
    softmax_scale: float,
) -> torch.Tensor:
    """fp32 [L, E]."""
    s = torch.einsum("lhd,ed->lhe", q.float(), keys.float())
    s = torch.relu(s) * softmax_scale
    return (s * weights.float().unsqueeze(-1)).sum(dim=1)


def causal_entry_mask(positions: torch.Tensor, num_entries: int, compress_rate: int) -> torch.Tensor:
    """[L, E] True where entry e is complete before query position t ends: e < (t + 1) // m."""
    limit = (positions + 1) // compress_rate
    return torch.arange(num_entries, device=positions.device)[None, :] < limit[:, None]


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """[L, E] bool: the top-k visible entries per row, ties to the lowest index."""
    L, E = scores.shape
    chosen = torch.zeros((L, E), dtype=torch.bool, device=scores.device)
    if E == 0 or topk <= 0:
        return chosen
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, : min(topk, E)]
    chosen.scatter_(1, order, True)
    return chosen & visible
