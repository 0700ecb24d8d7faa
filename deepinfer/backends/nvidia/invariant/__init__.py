"""Batch-invariant kernels of the nvidia backend (DEEPINFER_BATCH_INVARIANT=1; docs/determinism.md).

A row's bits must not depend on the rest of its batch, on how its prompt was chunked, on prefill vs
decode, or on the CUDA-graph bucket it was padded into. Every kernel here has one launch configuration
whatever the number of rows (tiles may depend on weight shapes, which are fixed per layer), reduces in
one fixed order, and uses no atomics whose order varies:

- gemm.py: one tile configuration for every M, no split-K (linears, lm_head, router logits, the
  absorbed W_UK / W_UV batched GEMMs);
- mla.py / mla_kernels.py: absorbed MLA for every token (prefill, chunks and decode alike) over the
  latent cache in splits of a FIXED number of entries, folded in split order;
- moe.py: one MoE path for every batch size: Triton router logits + per-token top-k, the expert-aligned
  grouped GEMMs with one BLOCK_M and tile, the combine in slot order;
- linear.py: the LinearMethod wrapper that routes every scheme's dense weight through gemm.py.

RMSNorm / add+RMSNorm (one row per program), RoPE, SiLU-and-mul and the KV write of the default
kernels are row-invariant as they stand; tests/nvidia/test_invariant_ops.py checks them anyway.
"""
