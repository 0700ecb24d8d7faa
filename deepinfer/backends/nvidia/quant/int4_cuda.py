"""The CUDA C++ int4 GEMVs (csrc/cuda/int4_gemv.cu): which shapes take them, and the calls.

Why they exist: at decode sizes the Triton int4 kernels are bound by dequantizing each weight in fp32 (about five
instructions a weight; ~1 TB/s of int4 weight at one token on the H100 / H200, docs/quantization.md). The CUDA
kernels convert two weights an instruction (the nibble OR-ed into a 16-bit float's mantissa, a packed subtraction
of the zero point) and multiply on the tensor cores (mma.m16n8k16, fp32 accumulation), which Triton does not emit.

Taken where all of this holds (else the Triton kernels run, as before):
- the CUDA C++ kernels are on (DEEPINFER_INT4_CUDA_GEMV, default: wherever DEEPINFER_NVIDIA_CUDA_EXT's kernels are);
- group size 128 and contiguous groups (AWQ, GPTQ without act-order), K a multiple of 128;
- bf16 or fp16 activations with 16-byte aligned rows, fp16 or fp32 scales;
- dense linears: 1 to 8 tokens with eight warps a tile (the default), 1 to 4 with four (auto_max_tokens; the kernel
  takes 8 when forced), a bias in the activation dtype;
- routed experts: one token (batch-1 decode), every slot routed (no expert parallelism's -1 ids), shared experts
  stacked after the routed ones or none, at most 16 slots (DEEPINFER_INT4_CUDA_SPLIT_K picks the kernels' variant).

Arithmetic: sum over groups of s * sum_k (q - z) x_k in fp32 (quant/tiles.py int4_row_dot's), so in bf16 the result
differs from the dequantize-then-multiply reference by the reference's rounding of each weight to bf16.
"""

from __future__ import annotations

import functools

import torch

from deepinfer import envs

GROUP = 128
MAX_TOKENS = 8  # what the dense kernel takes (the mma's N; a forced call, int4_gemm(cuda=True))
# what the default dispatch gives it at four warps a tile: on an H100 (2026-12-06, benchmarks/int4_cuda_gemv.py,
# V2-Lite's q_proj / kv_a / o_proj) an earlier layout (8 weight rows a warp) beat the Triton GEMM by 1.2-1.4x at one
# token and ~1.04x summed at four, and lost at 16 (13.5 against 8.2 us on q_proj: 16 staged rows of activations a
# block); this layout at four warps lost at 8 tokens (o_proj 7.62 against 6.52 us)
AUTO_MAX_TOKENS = 4
# at eight warps a tile (DEEPINFER_INT4_CUDA_DENSE_WARPS' default since session 32): faster than four at every count
# and than Triton at 8 tokens too (H100, session 32: q_proj 6.25 / kv_a 4.36 / o_proj 5.38 us against Triton's 7.96 /
# 5.57 / 6.52; one token 4.57 / 2.73 / 3.75 against four warps' 4.72 / 3.33 / 4.59)
AUTO_MAX_TOKENS_8_WARPS = 8
MAX_SLOTS = 16
MAX_STAGED_BYTES = 160 * 1024  # the kernels stage the activation rows in shared memory (rows x (K + 8) elements)
_ACT = (torch.bfloat16, torch.float16)
_SCALES = (torch.float16, torch.float32)


@functools.lru_cache(maxsize=1)
def _compiler() -> bool:
    from deepinfer.backends.nvidia import cuda_ext

    return cuda_ext.compiler_available()  # (a PATH / CUDA_HOME lookup: once a process)


def enabled() -> bool:
    """DEEPINFER_INT4_CUDA_GEMV, or (unset) whether the nvidia backend builds its CUDA C++ kernels: not turned off by
    DEEPINFER_NVIDIA_CUDA_EXT=0, and nvcc found (or forced on by DEEPINFER_NVIDIA_CUDA_EXT=1), as the backend's
    default. The environment decides: a backend constructed with use_cuda_ext=False (benchmarks/kernels_mla.py) does
    not reach these kernels' callers, which are free functions of the linear method and the MoE op."""
    flag = envs.INT4_CUDA_GEMV.get()
    if flag is not None:
        return flag
    ext_flag = envs.NVIDIA_CUDA_EXT.get()
    return ext_flag if ext_flag is not None else _compiler()


def ext():
    from deepinfer.backends.nvidia import cuda_ext

    return cuda_ext.load()  # BackendError naming the missing compiler when it cannot be built


def _aligned_rows(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and (t.stride(-2) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _offsets_fit(*tensors: torch.Tensor) -> bool:
    """The kernels address an element as a 32-bit offset within its expert (or the dense weight): the farthest
    element of each weight / scale tensor's last two dims under 2^32 (a 4-bit weight past 4 GB a projection is far
    beyond any model's)."""
    return all(sum((n - 1) * st for n, st in zip(t.shape[-2:], t.stride()[-2:])) < 1 << 32 for t in tensors)


def dense_reason(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                 group: int) -> str | None:
    """Why a dense int4 linear at this call cannot take the CUDA GEMV, or None."""
    if x.device.type != "cuda":
        return "not on a GPU"
    if not 1 <= x.shape[0] <= MAX_TOKENS:
        return f"{x.shape[0]} tokens (1 to {MAX_TOKENS})"
    if x.shape[0] * (x.shape[1] + 8) * x.element_size() > MAX_STAGED_BYTES:
        return f"{x.shape[0]} tokens of {x.shape[1]} channels exceed {MAX_STAGED_BYTES // 1024} KB of shared memory"
    return _weight_reason(x, qweight, scales, g_idx, group)


def _weight_reason(x, qweight, scales, g_idx, group) -> str | None:
    if g_idx is not None:
        return "act-order g_idx"
    if group != GROUP or x.shape[1] % GROUP:
        return f"group {group}, K {x.shape[1]} (group {GROUP}, K a multiple of it)"
    if x.dtype not in _ACT or scales.dtype not in _SCALES:
        return f"activations {x.dtype}, scales {scales.dtype}"
    if not (_aligned_rows(x) and _aligned_rows(qweight)):
        return "rows not 16-byte aligned"
    if not _offsets_fit(qweight, scales):
        return "a weight of 2^32 or more bytes a projection (32-bit row offsets)"
    return None


def moe_reason(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scale13: torch.Tensor, scale2: torch.Tensor,
               slots: int, group: int, skip_unrouted: bool, shared_out: torch.Tensor | None) -> str | None:
    """Why one token's int4 experts cannot take the CUDA GEMVs, or None."""
    if x.device.type != "cuda":
        return "not on a GPU"
    if x.shape[0] != 1:
        return f"{x.shape[0]} tokens (one)"
    if skip_unrouted or shared_out is not None:
        return "expert parallelism's skipped slots or a separate shared-expert output"
    if slots > MAX_SLOTS:
        return f"{slots} slots (at most {MAX_SLOTS})"
    if max(slots * (w2.shape[2] * 2 + 8), x.shape[1] + 8) * x.element_size() > MAX_STAGED_BYTES:
        return f"{slots} slots' activations exceed {MAX_STAGED_BYTES // 1024} KB of shared memory"
    inter = w2.shape[2] * 2
    if inter % GROUP or (inter * x.element_size()) % 16:
        return f"intermediate size {inter} (a multiple of {GROUP})"
    if not _aligned_rows(w2) or scale2.dtype not in _SCALES:
        return "down weight rows not 16-byte aligned, or its scales not fp16 / fp32"
    if not _offsets_fit(w2, scale2):
        return "a down weight of 2^32 or more bytes an expert (32-bit row offsets)"
    return _weight_reason(x, w13, scale13, None, group)


def auto_max_tokens() -> int:
    """The most tokens the default dispatch gives the dense GEMV (by DEEPINFER_INT4_CUDA_DENSE_WARPS)."""
    return AUTO_MAX_TOKENS_8_WARPS if envs.INT4_CUDA_DENSE_WARPS.get() == 8 else AUTO_MAX_TOKENS


def use_dense(x, qweight, scales, g_idx, group) -> bool:
    return (x.shape[0] <= auto_max_tokens() and enabled()
            and dense_reason(x, qweight, scales, g_idx, group) is None)


def use_moe(x, w13, w2, scale13, scale2, scheme: str | None, slots: int, group: int, skip_unrouted: bool,
            shared_out) -> bool:
    """Whether fused_moe's direct schedule runs these experts through the CUDA GEMVs (int4 schemes, one GPU token)."""
    return (scheme in ("int4_awq", "int4_gptq") and x.shape[0] == 1 and x.device.type == "cuda" and enabled()
            and moe_reason(x, w13, w2, scale13, scale2, slots, group, skip_unrouted, shared_out) is None)


def gemv(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
         bias: torch.Tensor | None) -> torch.Tensor:
    """[M, N] = x [M, K] @ W^T (+ bias), M <= 8; the row layout of quant/int4_gemm.py. The kernel reads the bias in
    the activation dtype (a model's biases are in it: the loader casts them to the compute dtype)."""
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return ext().int4_gemv(x, qweight, zeros, scales, bias.contiguous() if bias is not None else None,
                           envs.INT4_CUDA_DENSE_WARPS.get())


def moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scale13: torch.Tensor, scale2: torch.Tensor,
        zeros13: torch.Tensor, zeros2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        num_shared: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """One token's experts: [1, D] = sum over slots of round(down(silu(gate) * up)) * weight (shared slots 1.0),
    summed in fp32 in slot order and rounded once (fused_moe's direct schedule with its combine). perm: GPTQ
    act-order experts whose gate / up columns were sorted by group (quant/act_order.py), int32 [routed experts, D]:
    each block stages x's channels in that order."""
    m = ext()
    split = envs.INT4_CUDA_SPLIT_K.get()
    ids = topk_ids.to(torch.int64).contiguous()
    act = m.int4_moe_gate_up(x, w13, zeros13, scale13, ids, num_shared, split, perm)
    return m.int4_moe_down(act, w2, zeros2, scale2, ids, topk_weights.float().contiguous(), num_shared, split)
