"""The grammar bitmask apply op in torch: the oracle of the backends' fused kernels.

bitmask: int32 [M, W], bit (t % 32) of word (t // 32) set = token t allowed (the layout llguidance and
XGrammar fill). A token the mask does not cover (t >= 32 W) is forbidden, so a model whose
vocabulary is padded beyond the tokenizer never draws a padding id.
"""

from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set logits[rows[i], t] = -inf where bitmask[i] forbids t, in place; returns logits.

    logits: float [N, V]; bitmask: int32 [M, W] on logits' device; rows: int64 [M] (None: M == N, row i)."""
    m, words = bitmask.shape
    v = logits.shape[1]
    sel = logits if rows is None else logits.index_select(0, rows)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(m, words * 32).bool()
    if words * 32 < v:
        allowed = torch.cat([allowed, allowed.new_zeros(m, v - words * 32)], dim=1)
    sel.masked_fill_(~allowed[:, :v], float("-inf"))
    if rows is not None:
        logits.index_copy_(0, rows, sel)
    return logits
