"""The CUDA C++ int4 GEMVs (csrc/cuda/int4_gemv.cu, quant/int4_cuda.py).

On the CPU (CI): an emulation of the kernel's bit tricks and fragment mapping, written from the PTX ISA's
documented mma.m16n8k16 fragment layouts (not from the kernel), checked against the dequantize-then-multiply
reference; it proves the algorithm, not the compiled code. On the GPU (`gpu`): the kernels themselves at V2-Lite
shapes against the reference and the Triton paths, and under CUDA-graph capture.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvidia"))
from nvidia_testutil import DEVICE, ON_GPU  # noqa: I001  (sets TRITON_INTERPRET)
from moe_quant_util import make_experts, routing

from deepinfer.backend.native.moe import experts_forward

MAGIC = {"bf16": 0x4300, "fp16": 0x6400}  # 128.0 / 1024.0: their ulp is 1
ROUTED = 8  # routed experts in the GPU MoE tests (V2-Lite has 64; the shapes of each are V2-Lite's)


def _half_value(bits: int, kind: str) -> float:
    if kind == "fp16":
        return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])
    return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])


def _value_bits(v: float, kind: str) -> int:
    """A 16-bit float's bits (v exactly representable in it)."""
    if kind == "fp16":
        return int(np.array([v], dtype=np.float16).view(np.uint16)[0])
    bits = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
    assert bits & 0xFFFF == 0, v
    return bits >> 16


def _pair(word: int) -> tuple[int, int]:
    return word & 0xFFFF, word >> 16


def _nibble_pair(w: int, magic: int) -> int:
    """LOP3 (w & 0x000F000F) | (magic, magic)."""
    return (w & 0x000F000F) | (magic | magic << 16)


def _sub2(a: int, b: int, kind: str) -> int:
    """sub.rn.{bf16,f16}x2 of exactly representable differences (asserted)."""
    out = 0
    for shift in (0, 16):
        d = _half_value((a >> shift) & 0xFFFF, kind) - _half_value((b >> shift) & 0xFFFF, kind)
        out |= _value_bits(d, kind) << shift
    return out


def _byte_perm(a: int, b: int, sel: int) -> int:
    src = a | b << 32
    return sum(((src >> (8 * ((sel >> (4 * i)) & 0xF))) & 0xFF) << (8 * i) for i in range(4))


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_magic_number_conversion_is_exact_for_every_nibble_and_zero_point(kind):
    """(magic | q) - (magic | z) = q - z exactly, for all 16 x 16 pairs, in both halves of a register."""
    magic = MAGIC[kind]
    for q in range(16):
        for z in range(16):
            word = q | (15 - q) << 16
            d = _sub2(_nibble_pair(word, magic), (magic | z) * 0x00010001, kind)
            lo, hi = _pair(d)
            assert _half_value(lo, kind) == q - z and _half_value(hi, kind) == 15 - q - z


def _emulate_group(qbytes: np.ndarray, zeros: np.ndarray, x_bits: np.ndarray, grp: int, kind: str) -> np.ndarray:
    """One 128-channel group of the kernel's warp tile: qbytes uint8 [16, K/2] (the row layout), zeros [16], x_bits
    uint16 [8, K] (tokens' 16-bit floats). Returns C [16 rows, 8 tokens] = the mma products (fp64 here), built
    from per-lane fragments placed where the PTX ISA puts them (mma.m16n8k16, .row.col):
    A: a0 (row g, k 2t..2t+1), a1 (row g+8, same k), a2 (row g, k 2t+8..), a3 (row g+8, k 2t+8..);
    B: b0 (k 2t..2t+1, column g), b1 (k 2t+8.., column g); the lower half of a register is the lower index.
    A row is a weight row, a B column a token."""
    magic = MAGIC[kind]
    c = np.zeros((16, 8))
    for j in range(4):  # the lane's four words of each of its two rows: two mmas each
        for mma in range(2):
            a = np.zeros((16, 16))
            b = np.zeros((16, 8))
            for lane in range(32):
                g, t = lane // 4, lane % 4
                off = grp * 64 + 16 * t + 4 * j
                regs = {}
                for r, row in enumerate((g, g + 8)):  # a0 / a2 from row g, a1 / a3 from row g + 8
                    word = int.from_bytes(bytes(qbytes[row, off:off + 4]), "little")
                    zz = (magic | int(zeros[row])) * 0x00010001
                    regs[r] = _sub2(_nibble_pair(word >> (4 * (2 * mma)), magic), zz, kind)
                    regs[r + 2] = _sub2(_nibble_pair(word >> (4 * (2 * mma + 1)), magic), zz, kind)
                for reg_i, reg in regs.items():
                    row = g + (8 if reg_i in (1, 3) else 0)
                    k0 = 2 * t + (8 if reg_i >= 2 else 0)
                    lo, hi = _pair(reg)
                    a[row, k0], a[row, k0 + 1] = _half_value(lo, kind), _half_value(hi, kind)
                ch = grp * 128 + 32 * t + 8 * j
                xs = x_bits[g, ch:ch + 8].astype(np.uint32)  # token g's channels (B column g)
                words = [int(xs[2 * i]) | int(xs[2 * i + 1]) << 16 for i in range(4)]  # (x0,x1) (x2,x3) ...
                lo_src, hi_src = (words[0], words[2]) if mma == 0 else (words[1], words[3])
                for reg, k0 in ((_byte_perm(lo_src, hi_src, 0x5410), 2 * t), (_byte_perm(lo_src, hi_src, 0x7632),
                                                                             2 * t + 8)):
                    lo, hi = _pair(reg)
                    b[k0, g], b[k0 + 1, g] = _half_value(lo, kind), _half_value(hi, kind)
            c += a @ b
    return c


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_fragment_mapping_emulation_matches_the_reference(kind):
    """The kernel's per-lane loads, nibble pairs, activation byte permutes and per-group scale, assembled through
    the PTX fragment layouts, give ((q - z) * s) @ x^T for one 16-row tile and 8 tokens over two groups."""
    rng = np.random.default_rng(0)
    k = 256
    q = rng.integers(0, 16, size=(16, k))
    z = rng.integers(0, 16, size=(16, k // 128))
    s = rng.uniform(0.01, 0.1, size=(16, k // 128))
    qbytes = (q[:, 0::2] | q[:, 1::2] << 4).astype(np.uint8)  # low nibble = even channel
    dt = torch.bfloat16 if kind == "bf16" else torch.float16
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1)).to(dt)
    x_bits = x.view(torch.int16).numpy().view(np.uint16)
    got = np.zeros((16, 8))
    for grp in range(k // 128):
        got += _emulate_group(qbytes, z[:, grp], x_bits, grp, kind) * s[:, grp, None]
    dense = (q - np.repeat(z, 128, axis=1)) * np.repeat(s, 128, axis=1)
    want = dense @ x.double().numpy().T
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("int4_flag,ext_flag,want", [("1", "0", True), ("0", "1", False), ("", "0", False),
                                                       ("", "1", True)])
def test_the_cuda_gemv_switch_follows_its_flag_then_the_cuda_ext_flag(int4_flag, ext_flag, want, monkeypatch):
    """DEEPINFER_INT4_CUDA_GEMV decides where set; unset, DEEPINFER_NVIDIA_CUDA_EXT does (then whether nvcc is found,
    as the backend decides for its CUDA C++ kernels)."""
    from deepinfer.backends.nvidia.quant import int4_cuda

    monkeypatch.setenv("DEEPINFER_INT4_CUDA_GEMV", int4_flag)
    monkeypatch.setenv("DEEPINFER_NVIDIA_CUDA_EXT", ext_flag)
    assert int4_cuda.enabled() is want


def test_row_offsets_must_fit_32_bits():
    """The kernels address rows by 32-bit offsets within a projection: a stride that would overflow them keeps the
    weight off the CUDA path (a view with a huge row stride stands in for a 4 GB projection)."""
    from deepinfer.backends.nvidia.quant import int4_cuda

    small = torch.zeros(4, 64, dtype=torch.uint8)
    assert int4_cuda._offsets_fit(small, torch.zeros(2, 4, 3, dtype=torch.float16))
    huge = torch.empty_strided((4, 64), (1 << 31, 1), dtype=torch.uint8, device="meta")  # no storage needed
    assert not int4_cuda._offsets_fit(small, huge)


def test_the_dense_warps_knob_takes_four_or_eight(monkeypatch):
    from deepinfer import envs
    from deepinfer.errors import BackendError

    assert envs.INT4_CUDA_DENSE_WARPS.get() == 8
    monkeypatch.setenv("DEEPINFER_INT4_CUDA_DENSE_WARPS", "4")
    assert envs.INT4_CUDA_DENSE_WARPS.get() == 4
    monkeypatch.setenv("DEEPINFER_INT4_CUDA_DENSE_WARPS", "6")
    with pytest.raises(BackendError, match="DEEPINFER_INT4_CUDA_DENSE_WARPS"):
        envs.INT4_CUDA_DENSE_WARPS.get()


def test_the_split_knob_takes_one_two_four_or_eight(monkeypatch):
    from deepinfer import envs
    from deepinfer.errors import BackendError

    for value in (1, 2, 4, 8):
        monkeypatch.setenv("DEEPINFER_INT4_CUDA_SPLIT_K", str(value))
        assert envs.INT4_CUDA_SPLIT_K.get() == value
    monkeypatch.setenv("DEEPINFER_INT4_CUDA_SPLIT_K", "3")
    with pytest.raises(BackendError, match="DEEPINFER_INT4_CUDA_SPLIT_K"):
        envs.INT4_CUDA_SPLIT_K.get()


# ---------------------------------------------------------------- the kernels (GPU)

needs_gpu = pytest.mark.skipif(not ON_GPU, reason="the CUDA kernels need a GPU and nvcc")


def _dense_layer(n: int, k: int, seed: int, scale_dtype=torch.float16):
    """(qweight [N, K/2], zeros [N, K/128], scales [N, K/128] row-major, as TritonInt4Linear leaves them; the dense
    fp32 weight)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    z = torch.randint(0, 16, (k // 128, n), generator=g).to(torch.uint8)
    s = (torch.rand(k // 128, n, generator=g) * 0.02 + 0.001).to(scale_dtype)
    qweight = (q[:, 0::2] | q[:, 1::2] << 4).to(torch.uint8)
    rows = torch.arange(k) // 128
    dense = (q.float() - z.t().float()[:, rows]) * s.t().float()[:, rows]
    return qweight.to(DEVICE), z.t().contiguous().to(DEVICE), s.t().contiguous().to(DEVICE), dense.to(DEVICE)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,k", [(3072, 2048), (576, 2048), (2048, 1408), (44, 256)])
@pytest.mark.parametrize("m", [1, 5, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("warps", ["4", "8"])
def test_cuda_int4_gemv_matches_the_reference(n, k, m, dtype, bias, warps, monkeypatch):
    """V2-Lite's q_proj / kv_a / o_proj-like shapes and a partial 16-row tile (N 44), 1 / 5 / 8 tokens, 4 or 8 warps
    a tile (K 256: two groups, so at 8 warps six warps hold none): within the output dtype's rounding of the fp32
    product of the dequantized weight; and beside the Triton GEMM."""
    from deepinfer.backends.nvidia.quant.int4_gemm import int4_gemm

    monkeypatch.setenv("DEEPINFER_INT4_CUDA_DENSE_WARPS", warps)

    qw, z, s, dense = _dense_layer(n, k, seed=n + k + m)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    got = int4_gemm(x, qw, z, s, None, 128, b, cuda=True)
    want = x.float() @ dense.t() + (b.float() if bias else 0)
    tol = 4e-3 if dtype == torch.bfloat16 else 1e-3
    assert got.dtype == dtype and ((got.float() - want).norm() / want.norm()).item() < tol
    triton_y = int4_gemm(x, qw, z, s, None, 128, b, cuda=False)
    assert ((got.float() - triton_y.float()).norm() / want.norm()).item() < 2 * tol


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", [1, 3])
def test_cuda_int4_gemv_fp32_scales_and_the_default_dispatch(m):
    from deepinfer.backends.nvidia.quant import int4_cuda
    from deepinfer.backends.nvidia.quant.int4_gemm import int4_gemm

    qw, z, s, dense = _dense_layer(256, 512, seed=5, scale_dtype=torch.float32)
    x = torch.randn(m, 512, device=DEVICE).bfloat16()
    assert int4_cuda.use_dense(x, qw, s, None, 128)  # on by default where the CUDA C++ kernels build
    got = int4_gemm(x, qw, z, s, None, 128)
    assert torch.equal(got, int4_cuda.gemv(x, qw, z, s, None))
    want = x.float() @ dense.t()
    assert ((got.float() - want).norm() / want.norm()).item() < 4e-3


@pytest.mark.gpu
@needs_gpu
def test_cuda_int4_gemv_refuses_what_it_cannot_take():
    from deepinfer.backends.nvidia.quant import int4_cuda
    from deepinfer.backends.nvidia.quant.int4_gemm import int4_gemm
    from deepinfer.errors import BackendError

    qw, z, s, _ = _dense_layer(64, 256, seed=1)
    x = torch.randn(9, 256, device=DEVICE).bfloat16()
    with pytest.raises(BackendError, match="9 tokens"):
        int4_gemm(x, qw, z, s, None, 128, cuda=True)
    z64, s64 = z.repeat_interleave(2, 1), s.repeat_interleave(2, 1)  # the same weight in groups of 64
    with pytest.raises(BackendError, match="group 64"):
        int4_gemm(x[:1], qw, z64, s64, None, 64, cuda=True)
    assert not int4_cuda.use_dense(x, qw, s, None, 128)  # the default dispatch stops at 8 tokens (eight warps)


def test_the_default_dispatch_follows_the_dense_warps(monkeypatch):
    """Eight warps a tile (the default) take 1-8 tokens by default, four warps 1-4 (each measured against Triton)."""
    from deepinfer.backends.nvidia.quant import int4_cuda

    assert int4_cuda.auto_max_tokens() == int4_cuda.AUTO_MAX_TOKENS_8_WARPS == 8
    monkeypatch.setenv("DEEPINFER_INT4_CUDA_DENSE_WARPS", "4")
    assert int4_cuda.auto_max_tokens() == int4_cuda.AUTO_MAX_TOKENS == 4


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("stacked", [0, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", ["1", "2", "4", "8"])
def test_cuda_int4_moe_one_token_matches_the_references(split, stacked, dtype, monkeypatch):
    """V2-Lite's expert shapes (D 2048, I 1408, top-6, and 2 stacked shared experts or none; 8 routed experts, not
    64, so the CPU-side quantization of the test weights stays short), one token: the CUDA gate_up +
    down-with-combine against the dense twin (native experts_forward in the activation dtype) and against the
    Triton direct GEMMs; at every DEEPINFER_INT4_CUDA_SPLIT_K (8: down in 1024-thread blocks)."""
    from deepinfer.backends.nvidia.fused_moe import counters_for, fused_moe
    from deepinfer.backends.nvidia.quant import int4_cuda

    q, w13, w2 = make_experts("int4_awq", 1408, device=DEVICE, num_experts=ROUTED + stacked, hidden=2048)
    x = torch.randn(1, 2048, device=DEVICE).to(dtype)
    wts, ids = routing(1, k=6, device=DEVICE, num_experts=ROUTED)
    args = {"direct": True, "scheme": "int4_awq", "w13_scale": q.w13_scale, "w2_scale": q.w2_scale,
            "stacked_shared": stacked, "counters": counters_for(2048, DEVICE), "w13_zeros": q.w13_zeros,
            "w2_zeros": q.w2_zeros, "group_size": 128}
    assert int4_cuda.moe_reason(x, q.w13, q.w2, q.w13_scale, q.w2_scale, 6 + stacked, 128, False, None) is None
    monkeypatch.setenv("DEEPINFER_INT4_CUDA_SPLIT_K", split)  # each tile's groups over 1, 2, 4 or 8 warps
    got = fused_moe(x, q.w13, q.w2, wts, ids, **args)
    direct = int4_cuda.moe(x, q.w13, q.w2, q.w13_scale, q.w2_scale, q.w13_zeros, q.w2_zeros, ids, wts, stacked)
    assert torch.equal(got, direct)  # fused_moe took the CUDA path
    monkeypatch.setenv("DEEPINFER_INT4_CUDA_GEMV", "0")
    triton_y = fused_moe(x, q.w13, q.w2, wts, ids, **args)
    ref = experts_forward(x, w13[:ROUTED].to(dtype), w2[:ROUTED].to(dtype), wts, ids)
    for e in range(stacked):
        one = torch.ones(1, 1, device=DEVICE)
        ref = ref + experts_forward(x, w13.to(dtype), w2.to(dtype), one,
                                    torch.full((1, 1), ROUTED + e, device=DEVICE))
    for y in (got, triton_y):
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2
    assert ((got.float() - triton_y.float()).norm() / triton_y.float().norm()).item() < 1e-2


@pytest.mark.gpu
@needs_gpu
def test_cuda_int4_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs: the same bits as eager calls (no host sync or allocation inside)."""
    from deepinfer.backends.nvidia.quant import int4_cuda

    qw, z, s, _ = _dense_layer(3072, 2048, seed=2)
    q, _, _ = make_experts("int4_awq", 1408, device=DEVICE, num_experts=ROUTED + 2, hidden=2048)
    x = torch.randn(1, 2048, device=DEVICE).bfloat16()
    wts, ids = routing(1, k=6, device=DEVICE, num_experts=ROUTED)

    def step():
        return (int4_cuda.gemv(x, qw, z, s, None),
                int4_cuda.moe(x, q.w13, q.w2, q.w13_scale, q.w2_scale, q.w13_zeros, q.w2_zeros, ids, wts, 2))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    x.copy_(torch.randn(1, 2048, device=DEVICE).bfloat16())
    ids.copy_(routing(1, k=6, seed=9, device=DEVICE, num_experts=ROUTED)[1])
    graph.replay()
    for got, want in zip(outs, step()):
        assert torch.equal(got, want)
