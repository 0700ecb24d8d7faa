"""The MoE grouped GEMMs' shared device code: weight tiles per scheme, the K loop, and the epilogues.

Weights (QUANT, fused_moe_config.py): dense, fp8 e4m3 with 128x128 block scales, fp4 e2m1 with per-32 scales,
int4 (AWQ / GPTQ) with per-G zero points and scales. Activations (A_MODE):
- 0: the compute dtype; a quantized weight tile is dequantized in registers and rounded once to that dtype
  (W8A16 / W4A16), as the native oracle densifies an expert (backend/native/moe.py dequant_expert);
- 1: e4m3 with one fp32 scale per row per 128 channels, given (fp8_act_quant.py, or the gate_up epilogue
  below): W8A8, the fp8 tensor cores on both raw e4m3 tiles, each 128-wide K step's fp32 product times
  a_s * b_s added to the fp32 accumulator (the dense fp8 GEMM's arithmetic, quant/fp8_gemm.py);
- 2: the compute dtype, quantized per row per 128 channels as it is loaded (quant/tiles.py, the same values
  as mode 1's separate kernel): the direct schedule's few rows, where a separate launch costs more.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.backends.nvidia.quant.tiles import fp8_quant_rows, int4_tile


@triton.jit
def _load_w(b_base, q_base, z_base, g_base, rows, k0, kk, kmask, nmask, stride_bn, stride_qn, stride_qk,
            QUANT: tl.constexpr, E8M0: tl.constexpr, GROUP: tl.constexpr, GIDX: tl.constexpr, BLOCK_K: tl.constexpr,
            ACT: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] weight tile B[rows, kk]^T (kk = k0 + arange(BLOCK_K)), dequantized in registers when
    QUANT: 1 = fp8 e4m3 times its 128x128 block scale (BLOCK_K divides 128: one scale per row and tile),
    2 = fp4 e2m1 (two per byte, low nibble first) times its per-row per-32 scale (e8m0 bytes when E8M0, else
    fp32), 3 = int4 AWQ / GPTQ (quant/tiles.py int4_tile; BLOCK_K divides GROUP, or GIDX: g_base holds the
    expert's group of each input channel, GPTQ act-order, and the zero points and scales are gathered per
    channel). Dequantized in fp32 and rounded once to the activation dtype."""
    m = kmask[:, None] & nmask[None, :]
    # one constexpr branch is compiled (if / elif / else: an early return would not stop the compiler from
    # typing the branches after it against this scheme's pointer types)
    if QUANT == 0:
        out = tl.load(b_base + rows[None, :] * stride_bn + kk[:, None], mask=m, other=0.0)
    elif QUANT == 1:
        w = tl.load(b_base + rows[None, :] * stride_bn + kk[:, None], mask=m, other=0.0).to(tl.float32)
        sc = tl.load(q_base + (rows // 128) * stride_qn + (k0 // 128) * stride_qk, mask=nmask, other=0.0)
        out = (w * sc[None, :]).to(ACT)
    elif QUANT == 3:
        out = tl.trans(int4_tile(b_base, q_base, z_base, g_base, rows, nmask, k0, stride_bn, stride_qn, stride_qk,
                                 GIDX, GROUP, BLOCK_K, ACT))
    else:
        byte = tl.load(b_base + rows[None, :] * stride_bn + (kk // 2)[:, None], mask=m, other=0).to(tl.int32)
        nib = (byte >> ((kk % 2) * 4)[:, None]) & 0xF
        e = (nib >> 1) & 3
        man = (nib & 1).to(tl.float32)
        mag = tl.where(e == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        val = tl.where((nib & 8) != 0, -mag, mag)
        sc = tl.load(q_base + rows[None, :] * stride_qn + (kk // 32)[:, None] * stride_qk, mask=m, other=0)
        if E8M0:
            sc = tl.exp2(sc.to(tl.float32) - 127.0)
        else:
            sc = sc.to(tl.float32)
        out = (val * sc).to(ACT)
    return out


@triton.jit
def _fp8_b_scale(q_base, brows, n_blk, k0, nmask, stride_qn, stride_qk, BS_SCALAR: tl.constexpr):
    """The weight's 128x128 block scales b_s of one 128-wide K block, for the promotion of its product.

    BS_SCALAR (BLOCK_N divides 128 and the tile starts at a multiple of BLOCK_N: every caller's offs_n): all the
    tile's weight rows sit in one 128-row scale block n_blk, so b_s is one scalar, the promotion factor a_s * b_s a
    vector over the routed rows, and the promotion one FMA an element. Else b_s is one per column and the factor
    the outer product a_s x b_s, a multiply an element more in the K loop, where the W8A8 mainloop spends its
    non-MMA time. Both give each element the same fp32 factor a_s[m] * b_s[n]: the same results bit for bit."""
    if BS_SCALAR:
        b_s = tl.load(q_base + n_blk * stride_qn + (k0 // 128) * stride_qk)
    else:
        b_s = tl.load(q_base + (brows // 128) * stride_qn + (k0 // 128) * stride_qk, mask=nmask, other=0.0)
    return b_s


@triton.jit
def _fp8_step(acc, a, a_s, b_base, q_base, brows, n_blk, k0, kk, kmask, nmask, stride_bn, stride_qn, stride_qk,
              BS_SCALAR: tl.constexpr):
    """acc + (a @ B[brows, kk]^T) * a_s * b_s: one 128-wide K block of the W8A8 product."""
    b = tl.load(b_base + brows[None, :] * stride_bn + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
    b_s = _fp8_b_scale(q_base, brows, n_blk, k0, nmask, stride_qn, stride_qk, BS_SCALAR)
    if BS_SCALAR:
        out = acc + tl.dot(a, b) * (a_s * b_s)[:, None]
    else:
        out = acc + tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
    return out


@triton.jit
def _fp8_step_swapped(acc, a, a_s, b_base, q_base, brows, n_blk, k0, kk, kmask, nmask, stride_bn, stride_qn,
                      stride_qk, BS_SCALAR: tl.constexpr):
    """_fp8_step with the operands swapped: acc [BLOCK_N, BLOCK_M] + (B[brows, kk] @ a^T) * b_s * a_s. The weight
    rows fill the MMA's M (64 per warpgroup: the fp8 wgmma, QGMMA) and the few routed rows its N (16 / 32), where
    the unswapped tile below BLOCK_M 64 runs mma.sync on e4m3 converted to fp16 (swap-AB, as small-batch fp8 MoE
    kernels do). Both operands stay K-major, as the fp8 wgmma requires."""
    b = tl.load(b_base + brows[:, None] * stride_bn + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    b_s = _fp8_b_scale(q_base, brows, n_blk, k0, nmask, stride_qn, stride_qk, BS_SCALAR)
    if BS_SCALAR:
        out = acc + tl.dot(b, tl.trans(a)) * (a_s * b_s)[None, :]
    else:
        out = acc + tl.dot(b, tl.trans(a)) * (b_s[:, None] * a_s[None, :])
    return out


@triton.jit
def _mainloop(a_ptr, as_ptr, stride_as, rows, rmask, stride_am, b_base, u_off, offs_n, nmask, stride_bn, K,
              q_base, z_base, uq_off, stride_qn, stride_qk, g_base,
              DUAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
              QUANT: tl.constexpr, E8M0: tl.constexpr, GROUP: tl.constexpr, GIDX: tl.constexpr, A_MODE: tl.constexpr,
              ROUND_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SWAP_AB: tl.constexpr):
    """acc_g = A[rows] @ B[offs_n]^T (and acc_u with B's rows shifted by u_off when DUAL), fp32. u_off / uq_off
    shift the weight bytes / the scale rows (and the int4 zeros, laid out as the scales) to the up projection.
    GIDX (int4, GPTQ act-order): 1 = g_base holds the expert's group of each input channel, one for gate and up
    (the zero points and scales gathered per channel); 2 = the expert's weight columns were sorted by group at load
    (backends/nvidia/quant/act_order.py) and g_base holds the input channel of each sorted column: A's columns are
    gathered through it, the weight read as contiguous groups.
    A_MODE 1 / 2 (W8A8, QUANT 1, BLOCK_K 128): as_ptr holds mode 1's scales [rows, K/128] (row stride stride_as).
    SWAP_AB (A_MODE 1 / 2 only): the products run as B @ A^T (_fp8_step_swapped), transposed back at the end."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    brows = offs_n.to(tl.int64)
    ACT = a_ptr.dtype.element_ty
    BS_SCALAR: tl.constexpr = BLOCK_N <= 128  # BLOCK_N a power of two: it divides 128 (_fp8_b_scale)
    n_blk = tl.min(brows, 0) // 128  # the tile's scale row when BS_SCALAR
    if SWAP_AB:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    G_GATHER: tl.constexpr = GIDX == 1
    for k0 in range(0, K, BLOCK_K):
        kk = offs_k + k0
        kmask = kk < K
        if A_MODE == 0:
            if GIDX == 2:  # sorted weight columns: A's columns in the same order
                cols = tl.load(g_base + kk, mask=kmask, other=0)
                a = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0)
            else:
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = _load_w(b_base, q_base, z_base, g_base, brows, k0, kk, kmask, nmask, stride_bn, stride_qn, stride_qk,
                        QUANT, E8M0, GROUP, G_GATHER, BLOCK_K, ACT)
            if UPCAST:  # the interpreter's bf16 tl.dot is wrong (NOTES.md)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc_g += tl.dot(a, b, input_precision=PREC)
            if DUAL:
                u = _load_w(b_base + u_off, q_base + uq_off, z_base + uq_off, g_base, brows, k0, kk, kmask, nmask,
                            stride_bn, stride_qn, stride_qk, QUANT, E8M0, GROUP, G_GATHER, BLOCK_K, ACT)
                if UPCAST:
                    u = u.to(tl.float32)
                acc_u += tl.dot(a, u, input_precision=PREC)
        else:
            if A_MODE == 1:
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                a_s = tl.load(as_ptr + rows * stride_as + k0 // 128, mask=rmask, other=0.0)
            else:
                x = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                a, a_s = fp8_quant_rows(x, ROUND_FIRST)
            if SWAP_AB:
                acc_g = _fp8_step_swapped(acc_g, a, a_s, b_base, q_base, brows, n_blk, k0, kk, kmask, nmask,
                                          stride_bn, stride_qn, stride_qk, BS_SCALAR)
                if DUAL:
                    acc_u = _fp8_step_swapped(acc_u, a, a_s, b_base + u_off, q_base + uq_off, brows, n_blk, k0, kk,
                                              kmask, nmask, stride_bn, stride_qn, stride_qk, BS_SCALAR)
            else:
                acc_g = _fp8_step(acc_g, a, a_s, b_base, q_base, brows, n_blk, k0, kk, kmask, nmask, stride_bn,
                                  stride_qn, stride_qk, BS_SCALAR)
                if DUAL:
                    acc_u = _fp8_step(acc_u, a, a_s, b_base + u_off, q_base + uq_off, brows, n_blk, k0, kk, kmask,
                                      nmask, stride_bn, stride_qn, stride_qk, BS_SCALAR)
        a_ptrs += BLOCK_K
    if SWAP_AB:  # one return: the compiler types every return statement, even in a constexpr branch not taken
        out_g = tl.trans(acc_g)
        out_u = tl.trans(acc_u)
    else:
        out_g = acc_g
        out_u = acc_u
    return out_g, out_u


@triton.jit
def _epilogue(acc_g, acc_u, wv, ACT: tl.constexpr, DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr):
    if DUAL:  # silu(gate) * up with the native op's roundings
        gate = acc_g.to(ACT).to(tl.float32)
        up = acc_u.to(ACT).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(ACT).to(tl.float32)
        return act * up
    if MUL_WEIGHT:  # round to the activation dtype first, then weight in fp32 (as the native op)
        return acc_g.to(ACT).to(tl.float32) * wv[:, None]
    return acc_g


@triton.jit
def _store_fp8_rows(out, pairs, pmask, offs_n, nmask, c_ptr, cs_ptr, stride_cm, stride_cs, pid_n,
                    ACT: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """The gate_up output quantized for the W8A8 down GEMM: rounded to the activation dtype (the value the
    bf16 path stores), then e4m3 per row over this program's 128 channels (BLOCK_N = 128: channel group
    pid_n), scale to cs_ptr[pair, pid_n]."""
    val = tl.where(nmask[None, :], out.to(ACT).to(tl.float32), 0.0)
    q, s = fp8_quant_rows(val, ROUND_FIRST)
    p64 = pairs.to(tl.int64)
    tl.store(c_ptr + p64[:, None] * stride_cm + offs_n[None, :], q, mask=pmask[:, None] & nmask[None, :])
    tl.store(cs_ptr + p64 * stride_cs + pid_n, s, mask=pmask)
