"""The native (torch) `draft_pick` op: a draft and its confidence from the drafter's logits, written in place.

What the MTP drafter runs after the head of every chain link (backend/mtp_graph_runner.py's graphs and
spec/mtp_drafter.py's eager chain): the argmax of each row's logits (the draft) and its softmax probability (the
confidence the scheduler calibrates), written into the chain's buffers at the link's column. As torch ops that is
~6 kernels a link (the fp32 cast, softmax, max, the copies and scatters); a backend replaces it with one
(`Backend.draft_pick`). This is the oracle the conformance suite compares it against (conformance/runtime_cases.py).
"""

from __future__ import annotations

import torch


def draft_pick(logits: torch.Tensor, vocab: int, ids_out: torch.Tensor, conf_out: torch.Tensor,
               out_ids: torch.Tensor | None = None, out_conf: torch.Tensor | None = None,
               link: torch.Tensor | None = None) -> None:
    """For each of the b = logits.shape[0] rows: ids_out[r] = the argmax of logits[r, :vocab] (the first on ties),
    conf_out[r] = its softmax probability over logits[r, :vocab] in fp32 (1 / sum(exp(x - max))). With out_ids /
    out_conf ([>= b, K]) also there at column min(link, K - 1) (`link` a [1] int64 link index; None: column 0).
    logits: [b, >= vocab], any float dtype (upcast to fp32)."""
    b = logits.shape[0]
    probs = torch.softmax(logits[:, :vocab].float(), dim=-1)
    conf, ids = probs.max(dim=-1)
    ids_out[:b].copy_(ids)
    conf_out[:b].copy_(conf)
    if out_ids is None:
        return
    if link is None:  # the head: column 0, known on the host
        out_ids[:b, 0].copy_(ids)
        out_conf[:b, 0].copy_(conf)
        return
    col = link.clamp(max=out_ids.shape[1] - 1).expand(b, 1)  # a chain link: its column, on the device
    out_ids[:b].scatter_(1, col, ids.unsqueeze(1))
    out_conf[:b].scatter_(1, col, conf.unsqueeze(1))
