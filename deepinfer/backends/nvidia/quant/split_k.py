"""Split-K for the quantized dense GEMMs at decode sizes (quant/fp8_gemm.py, quant/int4_gemm.py).

Why: at one to sixteen tokens these GEMMs give one program per 32- or 64-wide column tile, so V2-Lite's o_proj
(N 2048) is 64 programs and q + kv_a 114 on a 132-SM GPU, and each program walks the whole K in series; layer 0's
dense down projection (K 10944, N 2048) took 44 us in fp8 and 93 us in int4 against 16 us in bf16 cuBLAS on the
H200 (docs/perf-log/2026-12-04-session12-h200.md, call 2). Splitting K over S programs per column tile fills the
SMs and shortens each program's serial chain of weight loads.

How: program (tile, s) multiplies K blocks [s * per, (s + 1) * per) and stores its fp32 partial in a workspace
[S, M, N]; `reduce_partials` then sums the S partials in a fixed order (s = 0, 1, ...), adds the bias and rounds
once to the output dtype. No atomics: the result does not depend on the programs' timing, so a seeded run repeats
bit for bit (it differs from the unsplit GEMM by fp32 summation order only). The extra launch (~2 us inside a CUDA
graph) and the workspace (S * M * N * 4 bytes, under 1 MB at these sizes) are what it costs.

When (`pick_split`): DEEPINFER_QUANT_SPLIT_K (on by default; 0 turns it off), M <= max_m (MAX_M, 16; FP8_MAX_M,
256, for the fp8 GEMM with x quantized by the separate kernel), and the unsplit grid under TARGET_PROGRAMS; S is the
smallest that reaches it, at least MIN_BLOCKS K blocks a split. The fp8 GEMM with x quantized apart goes up to 256
rows because from 65 rows it runs only where cuBLAS's block-scaled kernels cannot (K not a multiple of 128:
V2-Lite's layer-0 dense down projection, K 10944, whose 64 programs at 256 rows walked 86 K blocks each: 64.6 us
against bf16 cuBLAS's 29.3, and 31.3 us over four splits on the H100, 2026-12-05 session 22, `benchmarks.quant_gemm
--only dense --m 256 --sweep --splits 1,2,4,8`); at 17-64 rows (x quantized inside the GEMM) splits were not
measured, so they stay off there.

Measured (H100 80GB, 2026-12-05, c2c17e1, `benchmarks.quant_gemm --only dense --m 1,16`, graph replays): every
V2-Lite dense shape got faster or stayed, e.g. dense down (K 10944) fp8 43.4 -> 19.5 us and int4 92.2 -> 23.7 us,
o_proj fp8 9.8 -> 7.6 us; decode at batch 1 (prompt 1024): fp8 2.69 -> 2.57 ms a step, int4 2.67 -> 2.62 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import envs

MAX_M = 16  # decode-sized M only: above it the M tiles widen and the grids fill the GPU
FP8_MAX_M = 256  # the fp8 GEMM, x quantized apart (module docstring: from 65 rows only the shapes cuBLAS cannot take)
TARGET_PROGRAMS = 264  # two per SM on a 132-SM H100 / H200
MIN_BLOCKS = 2  # K blocks a split walks at least (fewer: the partial traffic and the reduce outweigh it)


def pick_split(m: int, programs: int, k_blocks: int, on_gpu: bool, split: int | None = None,
               max_m: int = MAX_M) -> int:
    """Splits of K for an [m, K] product whose unsplit grid has `programs` programs over `k_blocks` K blocks (1:
    no split), for a kernel that splits up to max_m rows. `split` forces it (tests, sweeps), capped at k_blocks."""
    if split is not None:
        return max(1, min(split, k_blocks))
    if not on_gpu or m > max_m or programs >= TARGET_PROGRAMS or not envs.QUANT_SPLIT_K.get():
        return 1
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, programs), k_blocks // MIN_BLOCKS))


def plan(m: int, n: int, programs: int, k_blocks: int, device: torch.device,
         split: int | None = None, max_m: int = MAX_M) -> tuple[int, int, torch.Tensor | None]:
    """(splits, K blocks per split, the fp32 workspace or None for one split) of a GEMM launch: pick_split's
    choice, with no empty split (the last may get fewer blocks)."""
    per = triton.cdiv(k_blocks, pick_split(m, programs, k_blocks, device.type == "cuda", split, max_m))
    splits = triton.cdiv(k_blocks, per) if k_blocks else 1
    return splits, max(per, 1), workspace(splits, m, n, device) if splits > 1 else None


@triton.jit
def _reduce_kernel(ws_ptr, c_ptr, bias_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # fixed order: the sum does not depend on which split finished first
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def workspace(split: int, m: int, n: int, device) -> torch.Tensor:
    """The fp32 partials [split, m, n] the split programs write (every element is written)."""
    return torch.empty((split, m, n), dtype=torch.float32, device=device)


def reduce_partials(ws: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out [m, n] (contiguous) = sum over s of ws[s] (+ bias), rounded once to out's dtype."""
    split, m, n = ws.shape
    mn = m * n
    block = 1024 if ws.device.type == "cuda" else 128
    _reduce_kernel[(triton.cdiv(mn, block),)](ws, out, bias if bias is not None else out, mn, n, SPLIT=split,
                                              HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out
