"""Batch-invariant kernels of the nvidia backend (DEEPINFER_BATCH_INVARIANT=1; docs/determinism.md).

A row's bits must not depend on the rest of its batch, on how its prompt was chunked, on prefill vs
decode, or on the CUDA-graph bucket it was padded into. Every kernel here computes a row with one
configuration whatever the number of rows (tiles and reduction splits may depend on weight shapes, fixed
per layer, never on M) and reduces in one fixed order. Where a fixed split of a reduction runs on several
programs, the last to arrive adds the parts in order; an atomic counter only picks that program
(counters.py):

- gemm.py: one tile and one fixed K split per weight, for every M (linears, lm_head, the router's split gate,
  the absorbed W_UK / W_UV batched GEMMs); the split's serial and parallel schedules give the same bits;
- mla.py / mla_kernels.py: absorbed MLA for every token (prefill, chunks and decode alike) over the
  latent cache in splits of a FIXED number of entries, folded in split order;
- moe.py: one MoE path for every batch size: router.py (the split gate's GEMM + the per-token top-k that
  sums its parts), moe_align.py (a counting sort by expert in token order), moe_gemm.py (the expert-aligned
  grouped GEMMs, shared experts folded in, one tile and K split), the combine in slot order;
- linear.py: the LinearMethod wrapper that routes every scheme's dense weight through gemm.py;
- tile_choice.py: faster tiles for some batch sizes (large GEMM tiles for prefill, the MoE's BLOCK_M 16 / 128,
  MLA's BLOCK_Q 4 on 8 warps for prefill and 8 warps for decode's split schedule), each used only after a bitwise
  check against the fixed tile on this device at load.

RMSNorm / add+RMSNorm (one row per program), RoPE, SiLU-and-mul and the KV write of the default
kernels are row-invariant as they stand; tests/nvidia/test_invariant_ops.py checks them anyway.
"""
