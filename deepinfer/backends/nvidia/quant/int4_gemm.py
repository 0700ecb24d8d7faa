"""int4 weight-only GEMM: y[M, N] = x[M, K] @ W^T, the weight kept 4-bit in memory.

The weight is in the row layout shared with the int4 routed experts (repacked once at load, still 4 bits a
value): uint8 [N, K/2] with two input channels per byte (low nibble = the even one), uint8 zero points and
fp16 scales [N, K/G] (GPTQ v1's zero offset already added), and for an act-order GPTQ weight only, g_idx
int32 [K] (the group of each input channel; contiguous groups need none). W = (q - z) * s.

Two paths, picked from M (a Python int, so fixed per captured CUDA graph), and a third, opt-in:
- M < DEEPINFER_INT4_DEQUANT_MIN_M (decode): `_int4_gemm_kernel` dequantizes each weight tile in registers
  (quant/tiles.py int4_tile) and feeds the tensor cores; DRAM carries the 4-bit stream, which is what
  small-M GEMMs wait on. The dequantization is paid once per (M tile, weight tile), so its cost grows with
  M / BLOCK_M: the tiles widen with M (16 rows at M <= 16 up to 128).
- larger M (prefill): `int4_dequantize` writes the dense weight in the compute dtype (one pass: N*K/2 bytes
  read, N*K*2 written), then cuBLAS multiplies. At M >= 512 the GEMM's own time dwarfs that pass (vLLM's
  AWQ method makes the same switch at 256 tokens), and cuBLAS beats a dequantizing Triton GEMM there.
- one token, contiguous groups, DEEPINFER_INT4_GEMV=1: `_int4_gemv_kernel`, the weight tiles reduced against the
  token with FMAs (no 16-row MMA tile, no trip through shared memory); slower than the MMA tile (session 12).
- 1-4 tokens, group 128, contiguous groups, on the GPU with the CUDA C++ kernels on (quant/int4_cuda.py): the
  CUDA GEMV of csrc/cuda/int4_gemv.cu, ahead of the paths above.

UPCAST (the interpreter: bf16 tl.dot is wrong there, NOTES.md): both operands go to fp32 instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.backends.nvidia.quant import int4_cuda, split_k
from deepinfer.backends.nvidia.quant.tiles import int4_row_dot, int4_tile
from deepinfer.errors import BackendError


@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, c_ptr, bias_ptr, M, N, K, KB_PER, stride_xm, stride_cm,
                      stride_wn, stride_sn, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                      GIDX: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Program (tile, s): K blocks [s * KB_PER, (s + 1) * KB_PER) of one output tile; with one split c is the output,
    else split s's fp32 partial [M, N] in split_k's workspace (as fp8_gemm.py)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_lo = pid_k * KB_PER * BLOCK_K
    k_hi = tl.minimum(k_lo + KB_PER * BLOCK_K, K)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # grouped ordering: GROUP_M row tiles share each weight tile while it is in L2
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    ACT = x_ptr.dtype.element_ty
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
        w = tl.trans(int4_tile(w_ptr, s_ptr, z_ptr, g_ptr, offs_n, nmask, k0, stride_wn, stride_sn, 1,
                               GIDX, GROUP, BLOCK_K, ACT))
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision=PREC)
        else:
            acc += tl.dot(a, w, input_precision=PREC)
        a_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    c_ptr += pid_k.to(tl.int64) * M * N
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, N, K, stride_wn, stride_sn,
                      HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token (M = 1): c[offs_n] = x . W[offs_n]^T, the int4 tile reduced against x with FMAs (tiles.py
    int4_row_dot), no 16-row MMA tile; contiguous groups only (no g_idx)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
        acc += int4_row_dot(w_ptr, s_ptr, z_ptr, rows, nmask, k0, x, stride_wn, stride_sn, 1, GROUP, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs_n, acc.to(c_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _int4_dequant_kernel(w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, stride_wn, stride_sn, stride_on,
                         GIDX: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    nmask = offs_n < N
    w = int4_tile(w_ptr, s_ptr, z_ptr, g_ptr, offs_n, nmask, k0, stride_wn, stride_sn, 1, GIDX, GROUP, BLOCK_K,
                  out_ptr.dtype.element_ty)
    ptrs = out_ptr + offs_n[:, None].to(tl.int64) * stride_on + (k0 + tl.arange(0, BLOCK_K))[None, :]
    tl.store(ptrs, w, mask=nmask[:, None])


SM_COUNT = 132  # H200 / H100 SXM; only steers the narrow-tile choice below (a smaller GPU just gets more waves)


def tiles(m: int, n: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the in-register path. Decode-sized M: the narrowest M tile
    the tensor cores take, and 32-wide N tiles where 64-wide ones would leave SMs idle (q_proj 3072 -> 96
    programs instead of 48); then wider M tiles, so each dequantized weight tile serves more rows."""
    if not on_gpu:
        return 16, 32, 4, 1
    narrow = 64 if triton.cdiv(n, 64) >= SM_COUNT else 32
    if m <= 16:
        return 16, narrow, 4, 4
    if m <= 32:
        return 32, narrow, 4, 4
    if m <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def dequant_min_m() -> int:
    """M from which the dense int4 linear dequantizes to the compute dtype and runs cuBLAS
    (DEEPINFER_INT4_DEQUANT_MIN_M; benchmarks/quant_gemm.py times both paths at each M)."""
    return envs.INT4_DEQUANT_MIN_M.get()


GEMV_BLOCK_N = 16  # output rows per GEMV program: o_proj (N 2048) is 128 programs, about one per SM


def use_gemv(m: int, g_idx: torch.Tensor | None, gemv: bool | None) -> bool:
    """The GEMV path (one token, contiguous groups): `gemv` when given (sweeps), else DEEPINFER_INT4_GEMV (off by
    default: not measured on a GPU yet)."""
    want = envs.INT4_GEMV.get() if gemv is None else gemv
    return bool(want) and m == 1 and g_idx is None


def _block_k(group: int, on_gpu: bool) -> int:
    return min(128 if on_gpu else 32, group)


def _check(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
           group: int) -> tuple[int, int]:
    n, k = qweight.shape[0], qweight.shape[1] * 2
    # an act-order g_idx may reference more groups than K / G (a tensor-parallel row part keeps every group's)
    groups_ok = scales.shape[1] == k // group if g_idx is None else scales.shape[1] >= k // group
    if qweight.dtype != torch.uint8 or zeros.dtype != torch.uint8 or tuple(zeros.shape) != tuple(scales.shape) \
            or zeros.stride() != scales.stride() or scales.dim() != 2 or scales.shape[0] != n or not groups_ok \
            or k % group or (scales.shape[1] > 1 and scales.stride(1) != 1) or qweight.stride(1) != 1:
        raise BackendError(f"int4_gemm: weight {tuple(qweight.shape)} {qweight.dtype}, zeros {tuple(zeros.shape)} "
                           f"{zeros.dtype}, scales {tuple(scales.shape)} strides {scales.stride()}: not the "
                           f"row-major [N, K/2] / [N, K/{group}] layout")
    if g_idx is not None and tuple(g_idx.shape) != (k,):
        raise BackendError(f"int4_gemm: g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
    return n, k


def int4_dequantize(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    group: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight in `dtype`: (q - z) * s in fp32, rounded once (the reference's values)."""
    n, k = _check(qweight, zeros, scales, g_idx, group)
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    on_gpu = qweight.device.type == "cuda"
    bk = _block_k(group, on_gpu)
    bn = 64 if on_gpu else 16
    _int4_dequant_kernel[(triton.cdiv(n, bn), k // bk)](
        qweight, scales, zeros, g_idx if g_idx is not None else qweight, out, n, qweight.stride(0),
        scales.stride(0), out.stride(0), GIDX=g_idx is not None, GROUP=group, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=4)
    return out


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor | None, group: int, bias: torch.Tensor | None = None,
              tile: tuple[int, int, int, int] | None = None, dequant: bool | None = None,
              gemv: bool | None = None, split: int | None = None, cuda: bool | None = None) -> torch.Tensor:
    """x [M, K] (compute dtype) -> [M, N] in x's dtype; the weight in this module's layout (see the docstring).
    tile (BLOCK_M, BLOCK_N, warps, stages) / dequant / gemv / split (K splits, quant/split_k.py) force a path: for
    tests and the benchmark's sweeps. One token with contiguous groups may take `_int4_gemv_kernel` (use_gemv).
    Up to 4 tokens at group 128 take the CUDA C++ GEMV where int4_cuda.use_dense says so; cuda=True forces it
    (BackendError with the reason where the shape cannot), cuda=False keeps the Triton kernels."""
    m, k_x = x.shape
    n, k = _check(qweight, zeros, scales, g_idx, group)
    if k_x != k:
        raise BackendError(f"int4_gemm: x has {k_x} input features, the weight {k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    on_gpu = x.device.type == "cuda"
    if cuda:
        reason = int4_cuda.dense_reason(x, qweight, scales, g_idx, group)
        if reason is not None:
            raise BackendError(f"int4_gemm: the CUDA GEMV cannot take this call: {reason}")
        return int4_cuda.gemv(x, qweight, zeros, scales, bias)
    forced = tile is not None or dequant is not None or gemv is not None or split is not None
    if cuda is None and not forced and on_gpu and int4_cuda.use_dense(x, qweight, scales, g_idx, group):
        return int4_cuda.gemv(x, qweight, zeros, scales, bias)
    if dequant if dequant is not None else (on_gpu and m >= dequant_min_m()):
        w = int4_dequantize(qweight, zeros, scales, g_idx, group, x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return c
    if use_gemv(m, g_idx, gemv):
        bn = tile[1] if tile else GEMV_BLOCK_N
        _int4_gemv_kernel[(triton.cdiv(n, bn),)](x, qweight, scales, zeros, c, bias if bias is not None else c, n, k,
                                                  qweight.stride(0), scales.stride(0), HAS_BIAS=bias is not None,
                                                  GROUP=group, BLOCK_N=bn, BLOCK_K=_block_k(group, on_gpu),
                                                  num_warps=tile[2] if tile else 4,
                                                  num_stages=tile[3] if tile else 1)
        return c
    bm, bn, warps, stages = tile or tiles(m, n, on_gpu)
    bk = _block_k(group, on_gpu)
    programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    splits, per, ws = split_k.plan(m, n, programs, k // bk, x.device, split)
    out = c if ws is None else ws
    _int4_gemm_kernel[(programs, splits)](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out,
        bias if bias is not None and splits == 1 else out, m, n, k, per, x.stride(0), n if splits > 1 else c.stride(0),
        qweight.stride(0), scales.stride(0), HAS_BIAS=bias is not None and splits == 1, UPCAST=not on_gpu,
        PREC="ieee" if x.dtype == torch.float32 else None, GIDX=g_idx is not None, GROUP=group, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    if splits > 1:
        split_k.reduce_partials(out, c, bias)
    return c
