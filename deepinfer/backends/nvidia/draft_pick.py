"""`draft_pick` in one Triton kernel: each row's draft (argmax) and confidence (its softmax probability), written
into the chain's buffers at the link's column.

The op's contract and its torch oracle are backend/native/draft_pick.py. Why a kernel: the MTP drafter runs it after
every chain link's head, inside the captured chain graph; as torch ops it is ~6 kernels (the fp32 cast, softmax,
max, the copies and scatters), each ~1 us of device time and ~1 us of gap, on a step whose device time is its
critical path once launched. One program per row, two passes over the vocabulary: the running max (the first index
on ties), then sum(exp(x - max)); the confidence is 1 / that sum, the softmax probability at the max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _draft_pick_kernel(logits_ptr, ids_ptr, conf_ptr, out_ids_ptr, out_conf_ptr, link_ptr, vocab, stride_l,
                       stride_o, K: tl.constexpr, HAS_OUT: tl.constexpr, HAS_LINK: tl.constexpr,
                       BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = logits_ptr + r.to(tl.int64) * stride_l
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 0, tl.int32)
    for v0 in range(0, vocab, BLOCK):  # per lane: its running max and the first index holding it
        x = tl.load(row + v0 + offs, mask=v0 + offs < vocab, other=float("-inf")).to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        best_i = tl.where(better, v0 + offs, best_i)
    m = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == m, best_i, 2147483647), axis=0)  # the first index over the lanes holding m
    total = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        x = tl.load(row + v0 + offs, mask=v0 + offs < vocab, other=float("-inf")).to(tl.float32)
        total += tl.exp(x - m)
    conf = 1.0 / tl.sum(total, axis=0)
    tl.store(ids_ptr + r, idx.to(tl.int64))
    tl.store(conf_ptr + r, conf)
    if HAS_OUT:
        col = 0
        if HAS_LINK:
            col = tl.minimum(tl.load(link_ptr), K - 1)
        tl.store(out_ids_ptr + r * stride_o + col, idx.to(tl.int64))
        tl.store(out_conf_ptr + r * stride_o + col, conf)


def draft_pick(logits: torch.Tensor, vocab: int, ids_out: torch.Tensor, conf_out: torch.Tensor,
               out_ids: torch.Tensor | None = None, out_conf: torch.Tensor | None = None,
               link: torch.Tensor | None = None) -> None:
    """Backend.draft_pick (backend/native/draft_pick.py) as one launch of b programs."""
    b = logits.shape[0]
    if b == 0:
        return
    if logits.stride(1) != 1 or logits.shape[1] < vocab:
        raise ValueError(f"draft_pick: logits {tuple(logits.shape)} must be row-major with >= {vocab} columns")
    if (out_ids is None) != (out_conf is None) or (out_ids is not None and out_ids.stride() != out_conf.stride()):
        raise ValueError("draft_pick: out_ids and out_conf come together, with one layout")
    k = out_ids.shape[1] if out_ids is not None else 1
    _draft_pick_kernel[(b,)](
        logits, ids_out, conf_out, out_ids if out_ids is not None else ids_out,
        out_conf if out_conf is not None else conf_out, link if link is not None else ids_out, vocab,
        logits.stride(0), out_ids.stride(0) if out_ids is not None else 0, K=k, HAS_OUT=out_ids is not None,
        HAS_LINK=link is not None, BLOCK=min(1024, triton.next_power_of_2(max(vocab, 16))), num_warps=4)
