"""Shared set-up for tests/nvidia: pick the GPU when there is one, else the Triton interpreter.

TRITON_INTERPRET must be set before any Triton kernel is defined, so every
test module imports this first.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed")
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The interpreter's bf16 tl.dot is wrong (NOTES.md); on the CPU the kernels upcast, and we test fp32 / fp16.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tol(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def backend():
    from deepinfer.backends.nvidia.backend import NvidiaBackend

    return NvidiaBackend(device=DEVICE)


def mla_decode_ref(q, cache, table, seq, L: int, scale: float) -> torch.Tensor:
    """Float64 absorbed MLA decode over a paged latent cache [blocks, page, L + R]: softmax(q . k) v per
    row and head, v = the first L latent columns; rows of length 0 give zeros (a padded row)."""
    page = cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], L, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(seq[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=cache.device)
        kv = cache.view(-1, cache.shape[-1])[table[b][pos // page].long() * page + pos % page].double().cpu()
        out[b] = ((q[b].double().cpu() @ kv.T) * scale).softmax(-1) @ kv[:, :L]
    return out
