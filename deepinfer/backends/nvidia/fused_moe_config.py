"""Launch configuration of the MoE grouped GEMMs (fused_moe_gemm.py): tiles per schedule and weight scheme, and
the per-scheme arguments (scales, zero points, the logical K) the kernels take.

Weight schemes (QuantizedExperts, backend/quantized_experts.py) map to the kernels' QUANT code: 0 dense, 1 fp8 128x128
blocks, 2 fp4 e2m1 per-32, 3 int4 (AWQ / GPTQ, one layout). "fp8_w8a8" is QUANT 1 with fp8 activations: the
kernels then run the fp8 tensor cores on (activation, weight) e4m3 tiles, one 128-wide K block per step.
"""

from __future__ import annotations

import torch
import triton

from deepinfer import envs
from deepinfer.errors import BackendError

QUANT_CODES = {None: 0, "fp8_block": 1, "fp8_w8a8": 1, "fp4": 2, "int4_awq": 3, "int4_gptq": 3}
PACKED = (2, 3)  # two 4-bit values per byte along K
FP8_ACT = ("fp8_w8a8",)  # schemes whose activations are quantized to e4m3 per token per 128 channels


def interpreting() -> bool:
    return envs.TRITON_INTERPRET.get() == "1"


def _tile_env(name: str) -> dict | None:
    """DEEPINFER_MOE_TILE / DEEPINFER_MOE_DIRECT_TILE (`name`), parsed; None when unset."""
    env = envs.BY_NAME[name].get()
    if not env:
        return None
    try:
        bn, bk, warps, stages = (int(v) for v in env.split(","))
    except ValueError:
        raise BackendError(f"{name} must be 'BLOCK_N,BLOCK_K,num_warps,num_stages', got {env!r}") from None
    return {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}


def _fit_scheme(cfg: dict, scheme: str | None, group_size: int) -> dict:
    """A K tile never straddles a scale block: fp8 blocks are 128 wide (W8A8 runs exactly one per step), int4
    groups group_size (the tile then has one zero point and scale per row)."""
    if scheme in FP8_ACT:
        return dict(cfg, block_k=128)
    if scheme == "fp8_block":
        return dict(cfg, block_k=min(cfg["block_k"], 128))
    if QUANT_CODES.get(scheme) == 3:
        return dict(cfg, block_k=min(cfg["block_k"], group_size))
    return cfg


SWAP_AB_MAX_BLOCK_M = 32  # aligned W8A8 tiles up to this BLOCK_M swap their operands by default
# Aligned W8A8 tiles below BLOCK_M 64 (swapped), per GEMM: the best of benchmarks/moe_tile_sweep.py at 256 tokens on
# the H200 (2026-12-04, docs/quantization.md): gate_up 139.5 -> 102.3 us, down 93.3 -> 60.1 us a layer.
W8A8_SWAPPED_TILES = {True: {"block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3},
                      False: {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}}


def w8a8_swap_ab(block_m: int, direct: bool = False) -> bool:
    """Whether a W8A8 grouped GEMM of BLOCK_M rows runs B @ A^T (fused_moe_mainloop._fp8_step_swapped): below
    BLOCK_M 64 the unswapped tile runs mma.sync on e4m3 converted to fp16, the swapped one the fp8 wgmma with
    the routed rows as its N. DEEPINFER_MOE_W8A8_SWAP_AB forces it either way (also under the interpreter);
    the direct schedule (not measured swapped) swaps only when forced."""
    forced = envs.MOE_W8A8_SWAP_AB.get()
    if forced is not None:
        return forced
    return not direct and block_m <= SWAP_AB_MAX_BLOCK_M


def gemm_config(block_m: int, dual: bool = False, scheme: str | None = None, group_size: int = 128) -> dict:
    """Aligned tile per BLOCK_M; DEEPINFER_MOE_TILE="BN,BK,warps,stages" overrides it (for tuning runs).

    DUAL programs read two BN-row weight slices, so they take BN/2: the same
    weight bytes per program (and shared memory) as the tuned single tile. Under fp8 activations the
    gate_up program keeps BN = 128 per half: its epilogue quantizes the SiLU-and-mul output per token per
    128 channels, one channel group per program, so the down GEMM reads e4m3 (half the bytes) and needs no
    quantization pass. 8 warps: with 4, the gate_up program spills at BLOCK_M 32 and 64 (sm_90 compile of
    Triton 3.9 before the one-FMA promotion of 2026-12-05: 255 registers + 152 / 472 bytes of stack; 8 warps:
    216 / 254 registers, no stack; since: 182 at BLOCK_M 64, and BLOCK_M 128 at 255 + 24 bytes, the prefill
    gate_up). The down program takes 4 warps at BLOCK_M 64 (238 registers, no stack; 8 warps were 1.45x slower at
    16384 tokens in the H200 sweep of 2026-12-04). BLOCK_M 64 and 128 run QGMMA (fp8 wgmma). Below 64
    the unswapped tile would convert the e4m3 tiles to fp16 for mma.sync (HMMA); those tiles swap their operands
    instead (w8a8_swap_ab: QGMMA with the routed rows as N) and take W8A8_SWAPPED_TILES, the sweep's best
    (gate_up at 4 warps: 255 registers, no stack, in the sm_90 compile of Triton 3.9).
    """
    if interpreting():
        cfg = {"block_n": 16 if dual else 32, "block_k": 16, "num_warps": 4, "num_stages": 1}
        if scheme in FP8_ACT:
            cfg = {"block_n": 128 if dual else 32, "block_k": 128, "num_warps": 4, "num_stages": 1,
                   "swap_ab": w8a8_swap_ab(block_m)}
        return _fit_scheme(cfg, scheme, group_size)
    cfg = _tile_env("DEEPINFER_MOE_TILE")
    if scheme in FP8_ACT:
        swap = w8a8_swap_ab(block_m)
        if cfg is None and swap and block_m <= SWAP_AB_MAX_BLOCK_M:
            cfg = W8A8_SWAPPED_TILES[dual]
        elif cfg is None and block_m >= 128:  # the prefill gate_up (fused_moe.W8A8_BLOCK_M_128_MIN_PAIRS): the H100
            # sweep's best at 16384 tokens (2026-12-05); the down GEMM's 128-row tile, which fused_moe does not
            # pick by default, at its best there
            cfg = {"block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 4}
        elif cfg is None:  # down at 4 warps: 1984 -> 1370 us a layer at 16384 tokens (sweep, H200 2026-12-04)
            cfg = ({"block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3} if dual
                   else {"block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3})
        cfg = dict(cfg, swap_ab=swap)
        if dual:
            cfg = dict(cfg, block_n=128)
        return _fit_scheme(cfg, scheme, group_size)
    if cfg is None:
        if block_m >= 128:  # 16-bit prefill tiles (fused_moe.pick_block_m): the sweep's best at 16384 tokens
            cfg = {"block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 4}
        elif block_m <= 32:  # decode: H200 sweep (docs/perf-log/2026-11-29-first-h200-baseline.md): all tiles within ~10%, this one best at 1 token
            cfg = {"block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3}
        else:
            cfg = {"block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}
    if dual:
        cfg = dict(cfg, block_n=max(16, cfg["block_n"] // 2))
    return _fit_scheme(cfg, scheme, group_size)


# the split W8A8 gate_up (fused_moe.split_gate_up) at 128 rows: one fp32 accumulator, 8 warps (sm_90 compile of
# Triton 3.9: 220 registers, no stack); the split path ran 2-4% slower than the dual GEMM on an H100 (2026-12-05)
W8A8_SPLIT_GATE_UP_TILE = {"block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3}


def split_gate_up_config(block_m: int) -> dict:
    """The split W8A8 gate_up's tile (a single GEMM over both halves); DEEPINFER_MOE_TILE overrides it as it does
    the others'. Under the interpreter, the aligned single GEMM's tile."""
    if interpreting():
        return gemm_config(block_m, False, "fp8_w8a8")
    cfg = _tile_env("DEEPINFER_MOE_TILE") or W8A8_SPLIT_GATE_UP_TILE
    return _fit_scheme(dict(cfg, swap_ab=w8a8_swap_ab(block_m)), "fp8_w8a8", 128)


# GPTQ act-order's gate_up (fused_moe w13_g_idx; quant/tiles.py int4_tile GIDX gathers a zero point and a scale a
# weight, for gate and up both): K tiles of at most this many channels. At the default direct tile's 128 the sm_90
# compile (Triton 3.9) took 255 registers and 464 bytes of stack; at 32, 156 (direct) / 157 (aligned BLOCK_M 32)
# registers and none (tests/nvidia/moe_sm90_compile.py). Not timed on a GPU
GIDX_MAX_BLOCK_K = 32


def gidx_config(cfg: dict) -> dict:
    """A default tile (gemm_config / direct_config) for an act-order gate_up: BLOCK_K capped (GIDX_MAX_BLOCK_K)."""
    return dict(cfg, block_k=min(cfg["block_k"], GIDX_MAX_BLOCK_K))


def gidx_args(g_idx: torch.Tensor | None, quant: int, num_experts: int, k: int, dummy: torch.Tensor,
              what: str) -> tuple[torch.Tensor, int]:
    """(pointer, expert stride) of a GPTQ act-order weight's groups (int32 [E, K]: the input channel k of expert e in
    group g_idx[e, k]; quant/tiles.py int4_tile gathers the zero points and scales per channel), or a stand-in the
    kernel never reads. BackendError for a g_idx on other than int4 weights, or of another shape."""
    if g_idx is None:
        return dummy, 0
    if quant != 3 or g_idx.dtype != torch.int32 or g_idx.dim() != 2 or g_idx.shape[1] != k \
            or g_idx.shape[0] < num_experts or g_idx.stride(1) != 1:
        raise BackendError(f"{what}: g_idx {tuple(g_idx.shape)} {g_idx.dtype} is int4 act-order's, int32 "
                           f"[>= {num_experts}, {k}] with contiguous rows")
    return g_idx, g_idx.stride(0)


def direct_config(dual: bool, scheme: str | None = None, group_size: int = 128) -> dict:
    """Direct-mode tile; DEEPINFER_MOE_DIRECT_TILE="BN,BK,warps,stages" overrides it (BN counts both halves
    of a DUAL program: 128 = 64 gate + 64 up rows)."""
    if interpreting():
        cfg = {"block_n": 16 if dual else 32, "block_k": 16, "num_warps": 4, "num_stages": 1}
        if scheme in FP8_ACT:
            cfg = dict(cfg, block_k=128, swap_ab=w8a8_swap_ab(16, direct=True))
        return _fit_scheme(cfg, scheme, group_size)
    cfg = _tile_env("DEEPINFER_MOE_DIRECT_TILE") or {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}
    if dual:
        cfg = dict(cfg, block_n=max(16, cfg["block_n"] // 2))
    if scheme in FP8_ACT:  # a direct program's BLOCK_M: 16 up to 16 tokens
        cfg = dict(cfg, swap_ab=w8a8_swap_ab(16, direct=True))
    return _fit_scheme(cfg, scheme, group_size)


def quant_args(w: torch.Tensor, scale: torch.Tensor | None, scheme: str | None, dual: bool, n_out: int,
               zeros: torch.Tensor | None = None):
    """(K, scale tensor, zeros tensor, uq_off, (stride_qe, stride_qn, stride_qk), QUANT, E8M0) for a weight of
    `scheme`: the logical K (fp4 / int4 pack two per byte), and the up projection's scale offset (fp8: the gate
    grid's rows, fp4 / int4: I rows) for a DUAL weight. int4's zeros are laid out as its scales (same offsets)."""
    if scheme not in QUANT_CODES:
        raise BackendError(f"MoE grouped GEMM: weight scheme {scheme!r} (known: "
                           f"{', '.join(s for s in QUANT_CODES if s)})")
    if scheme is None:
        return w.shape[2], w, w, 0, (0, 0, 0), 0, False
    if scale is None or scale.dim() != 3 or scale.shape[0] != w.shape[0]:
        raise BackendError(f"MoE grouped GEMM: {scheme} weights need a [E, rows, cols] scale")
    code = QUANT_CODES[scheme]
    if code == 3:
        if zeros is None or zeros.shape != scale.shape or zeros.stride() != scale.stride() or zeros.dtype != torch.uint8:
            raise BackendError(f"MoE grouped GEMM: {scheme} weights need uint8 zeros of the scale's shape and strides")
    else:
        zeros = scale  # never read
    k = w.shape[2] * (2 if code in PACKED else 1)
    uq = 0
    if dual:
        uq = (scale.shape[1] // 2 if code == 1 else n_out) * scale.stride(1)
    return (k, scale, zeros, uq, (scale.stride(0), scale.stride(1), scale.stride(2)), code,
            scale.dtype == torch.uint8)


def prec(dtype: torch.dtype):
    return "ieee" if dtype == torch.float32 else None  # fp32 tl.dot defaults to TF32 on the GPU


def block_p(num_pairs: int) -> int:
    return triton.next_power_of_2(num_pairs)
