"""Structured output's grammar bitmask apply in Triton: one pass over the constrained rows' logits.

Why a kernel: the torch-native op expands the int32 words into a [M, 32 W] bool tensor and writes
the selected rows back (several passes and allocations per step); here each program reads a block
of BLOCK logits of one constrained row and the BLOCK / 32 words that cover it, and writes -inf in
place where the bit is clear (or where the mask does not reach: padded vocabulary). Same result as
deepinfer.backend.native.grammar.apply_token_bitmask, bit for bit (checked under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_bitmask_kernel(logits_ptr, mask_ptr, rows_ptr, V, W, stride_l, stride_m,
                          HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < V
    word_idx = offs // 32
    words = tl.load(mask_ptr + i * stride_m + word_idx, mask=in_vocab & (word_idx < W), other=0)
    bit = (words >> (offs % 32)) & 1
    forbid = in_vocab & (bit == 0)
    tl.store(logits_ptr + row * stride_l + offs, tl.full([BLOCK], float("-inf"), tl.float32).to(
        logits_ptr.dtype.element_ty), mask=forbid)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    from deepinfer.errors import BackendError

    if logits.dim() != 2 or logits.stride(1) != 1 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise BackendError(f"apply_token_bitmask expects row-contiguous logits [N, V] and int32 bitmask [M, W], got "
                           f"{tuple(logits.shape)} / {tuple(bitmask.shape)} {bitmask.dtype}")
    m, w = bitmask.shape
    if rows is None and m != logits.shape[0]:
        raise BackendError(f"apply_token_bitmask: {m} mask rows for {logits.shape[0]} logit rows and no row index")
    if m == 0:
        return logits
    bitmask = bitmask.contiguous()
    v = logits.shape[1]
    block = 1024
    _apply_bitmask_kernel[(m, triton.cdiv(v, block))](
        logits, bitmask, rows if rows is not None else bitmask, v, w, logits.stride(0), bitmask.stride(0),
        HAS_ROWS=rows is not None, BLOCK=block,
    )
    return logits
