"""The nvidia backend's quantized linear kernels against the torch references (interpreter at tiny shapes,
`gpu` at V2-Lite shapes). Tolerances: fp8 W8A8 GEMM vs the fp32 reference on the same quantized operands
rel 1e-5 (fp32 accumulation, order only) under the interpreter, 2e-2 in bf16 on the GPU (output rounding);
int4 rel 1e-5 (fp32 upcast) / 2e-2 (bf16)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend import NativeOps, dequant_fp8_block, quantize_act_fp8, quantize_weight_fp8_block
from deepinfer.backend.native.quant_fp8 import w8a8_block_linear_ref

triton = pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("m,k", [(1, 128), (7, 300), (33, 256)])
def test_act_quant_kernel_matches_reference(m, k):
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8 as kq

    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    q, s = kq(x.to(DEV))
    rq, rs = quantize_act_fp8(x)
    assert torch.equal(s.cpu(), rs)
    v = (x / rs.repeat_interleave(128, 1)[:, :k]).abs()
    normal = v >= 2**-6  # e4m3 normals: exact; subnormals within one subnormal step (2^-9)
    assert torch.equal(q.cpu().float()[normal], rq.float()[normal])
    assert ((q.cpu().float() - rq.float()).abs() <= 2**-9).all()


def _layer(w, s=None, bias=None):
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    layer.weight_scale_inv = None if s is None else torch.nn.Parameter(s, requires_grad=False)
    layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    return layer


@pytest.mark.parametrize("m,n,k", [(1, 136, 200), (5, 64, 256), (19, 200, 136)])
def test_fp8_w8a8_method_matches_native(m, n, k):
    from deepinfer.backends.nvidia.quant.linear_methods import TritonFp8W8A8Linear

    g = torch.Generator().manual_seed(n)
    wq, ws = quantize_weight_fp8_block(torch.randn(n, k, generator=g) * k**-0.5)
    bias = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    ours = TritonFp8W8A8Linear()
    lay = _layer(wq.clone().to(DEV), ws.clone().to(DEV), bias.clone().to(DEV))
    ours.process_weights(lay, torch.float32)
    assert lay.weight.dtype == torch.float8_e4m3fn  # kept quantized
    y = ours.apply(lay, x.to(DEV))
    ref = NativeOps().linear_method("fp8_w8a8")
    rl = _layer(wq.clone(), ws.clone(), bias.clone())
    ref.process_weights(rl, torch.float32)
    r = ref.apply(rl, x)
    assert not y.isnan().any()
    assert _rel(y.cpu(), r) < 1e-5
    torch.testing.assert_close(ours.dense_weight(lay).cpu(), dequant_fp8_block(wq, ws))


@pytest.mark.parametrize("m", [1, 7, 19, 40])
def test_fp8_gemm_fused_act_quant_equals_separate(m):
    """The GEMM quantizing A as it loads it (decode) gives the same product as the separate act-quant kernel
    followed by the e4m3 GEMM (prefill): bitwise. Ragged M, N (200: a partial 128-block) and K (300)."""
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8 as kq
    from deepinfer.backends.nvidia.quant.fp8_gemm import fp8_block_gemm

    g = torch.Generator().manual_seed(m)
    wq, ws = quantize_weight_fp8_block(torch.randn(200, 300, generator=g) * 300**-0.5)
    x = torch.randn(m, 300, generator=g).to(DEV)
    wq, ws = wq.to(DEV), ws.to(DEV)
    fused = fp8_block_gemm(x, None, wq, ws, torch.float32)
    sep = fp8_block_gemm(*kq(x), wq, ws, torch.float32)
    assert torch.equal(fused, sep)
    ref = w8a8_block_linear_ref(x.cpu(), dequant_fp8_block(wq.cpu(), ws.cpu()))
    assert _rel(fused.cpu(), ref) < 1e-5


@pytest.mark.parametrize("m,split", [(1, 2), (5, 3), (19, 2)])
def test_fp8_gemm_split_k_equals_one_split(m, split):
    """K split over programs (quant/split_k.py: fp32 partials, summed in a fixed order, the bias added once): the
    unsplit product up to fp32 summation order, with the activations quantized in the GEMM (each split its own
    128-channel groups) and separately. K 300 (3 blocks, the last partial), N 200, a bias."""
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8 as kq
    from deepinfer.backends.nvidia.quant.fp8_gemm import fp8_block_gemm

    g = torch.Generator().manual_seed(10 + m)
    wq, ws = quantize_weight_fp8_block(torch.randn(200, 300, generator=g) * 300**-0.5)
    x = torch.randn(m, 300, generator=g).to(DEV)
    bias = torch.randn(200, generator=g).to(DEV)
    wq, ws = wq.to(DEV), ws.to(DEV)
    one = fp8_block_gemm(x, None, wq, ws, torch.float32, bias, split=1)
    for a, a_s in ((x, None), kq(x)):
        got = fp8_block_gemm(a, a_s, wq, ws, torch.float32, bias, split=split)
        assert _rel(got.cpu(), one.cpu()) < 1e-6 and not torch.equal(got, torch.zeros_like(got))
    ref = w8a8_block_linear_ref(x.cpu(), dequant_fp8_block(wq.cpu(), ws.cpu())) + bias.cpu()
    assert _rel(one.cpu(), ref) < 1e-5


def test_split_k_choice(monkeypatch):
    """pick_split: on by default, off with DEEPINFER_QUANT_SPLIT_K=0 (unless forced), only at decode-sized M on a GPU,
    only where the grid is short of two programs an SM, enough to reach it but at least two K blocks a split; forced
    splits are capped at the K blocks."""
    from deepinfer.backends.nvidia.quant.split_k import pick_split

    monkeypatch.setenv("DEEPINFER_QUANT_SPLIT_K", "0")
    assert pick_split(1, 64, 16, on_gpu=True) == 1
    assert pick_split(1, 64, 16, on_gpu=False, split=4) == 4 and pick_split(1, 64, 3, on_gpu=True, split=8) == 3
    monkeypatch.delenv("DEEPINFER_QUANT_SPLIT_K", raising=False)
    assert pick_split(1, 64, 16, on_gpu=True) == 5  # o_proj at one token: 64 programs -> 320
    assert pick_split(1, 64, 86, on_gpu=True) == 5 and pick_split(1, 18, 16, on_gpu=True) == 8  # kv_a: 8 x 2 blocks
    assert pick_split(1, 64, 3, on_gpu=True) == 1  # too few K blocks for two a split
    assert pick_split(17, 64, 16, on_gpu=True) == 1 and pick_split(1, 300, 16, on_gpu=True) == 1
    assert pick_split(1, 64, 16, on_gpu=False) == 1
    # the fp8 GEMM splits up to 256 rows (split_k.FP8_MAX_M): layer 0's dense down at 256 rows, 64 programs x 86
    # K blocks (what cuBLAS cannot take, K % 128 != 0) -> 5 splits; the int4 GEMM's default stays at 16
    assert pick_split(256, 64, 86, on_gpu=True, max_m=256) == 5 and pick_split(257, 64, 86, True, max_m=256) == 1
    assert pick_split(256, 64, 86, on_gpu=True) == 1


def _int4_layer(method: str, n: int, k: int, group: int, seed: int, act_order: bool = False):
    """A TritonInt4Linear layer (fp32 compute) and the native reference layer of the same packed weight."""
    from deepinfer.backend import Int4Weight
    from deepinfer.checkpoints.awq_writer import pack_awq_cols, pack_gptq, quantize_int4

    g = torch.Generator().manual_seed(seed)
    q, z, s = quantize_int4(torch.randn(n, k, generator=g) * 0.05, group)
    if method == "awq":
        rec = lambda: Int4Weight("awq", pack_awq_cols(q), pack_awq_cols(z), s, group_size=group)  # noqa: E731
    else:
        qw, qz = pack_gptq(q, z)
        rows = torch.randperm(k, generator=g) if act_order else torch.arange(k)
        gidx = (rows // group).to(torch.int32)
        rec = lambda: Int4Weight("gptq", qw, qz, s, gidx, group, zero_offset=1)  # noqa: E731
    return rec


@pytest.mark.parametrize("rank", [0, 1])
def test_int4_linear_takes_an_act_order_row_part(rank):
    """A tensor-parallel rank's row part of a GPTQ act-order record (every group's zero points and scales, its rows'
    g_idx as stored: Int4Weight.part) through TritonInt4Linear: the dequantized kernel weight is the native
    reference's bit for bit, and the GEMM's product matches it (the interpreter on the CPU)."""
    from deepinfer.backends.nvidia.quant.int4_gemm import int4_dequantize, int4_gemm
    from deepinfer.backends.nvidia.quant.linear_methods import TritonInt4Linear

    n, k, group = 40, 256, 64
    rec = _int4_layer("gptq", n, k, group, 7, act_order=True)
    part = lambda: rec().part(1, rank * 128, (rank + 1) * 128, "x.o_proj")
    assert part().num_groups == k // group
    lay, rl = torch.nn.Module(), torch.nn.Module()
    lay.int4, lay.bias, lay.weight = part(), None, None
    rl.int4, rl.bias, rl.weight = part(), None, None
    TritonInt4Linear("gptq").process_weights(lay, torch.float32)
    lay.to(DEV)
    ref = NativeOps().linear_method("int4_gptq")
    ref.process_weights(rl, torch.float32)
    assert lay.g_idx_k is not None and lay.scales_ng.shape == (n, k // group)  # every group, K / G of the whole
    dense = int4_dequantize(lay.qweight_nk, lay.zeros_ng, lay.scales_ng, lay.g_idx_k, group, torch.float32)
    assert torch.equal(dense.cpu(), rl.weight)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    y = int4_gemm(x.to(DEV), lay.qweight_nk, lay.zeros_ng, lay.scales_ng, lay.g_idx_k, group, None)
    torch.testing.assert_close(y.cpu(), ref.apply(rl, x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method,group,act_order,sort", [("awq", 32, False, True), ("awq", 64, False, True),
                                                         ("gptq", 128, True, True), ("gptq", 128, True, False),
                                                         ("gptq", 64, False, True)])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_int4_gemm_paths_match_native(method, group, act_order, sort, m, monkeypatch):
    """The paths of the dense int4 linear (in-register dequantization, also with K split over programs;
    dequantize-then-matmul, the prefill path; at one token the GEMV) against the native reference: group sizes
    32 / 64 / 128, act-order (sorted by group at load with x gathered through perm_k, DEEPINFER_INT4_ACT_ORDER_SORT;
    or as stored, g_idx gathered per channel), ragged M and N (40: a partial N tile), a bias. The dequantized weight
    is bit-exact (in the sorted layout: the reference's columns in perm_k's order; dense_weight back in input
    order); products within fp32 summation order."""
    monkeypatch.setenv("DEEPINFER_INT4_ACT_ORDER_SORT", "1" if sort else "0")
    from deepinfer.backends.nvidia.quant.int4_gemm import int4_dequantize, int4_gemm
    from deepinfer.backends.nvidia.quant.linear_methods import TritonInt4Linear

    n, k = 40, 256
    rec = _int4_layer(method, n, k, group, m, act_order)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    lay = torch.nn.Module()
    lay.int4, lay.bias, lay.weight = rec(), bias.clone(), None
    TritonInt4Linear(method).process_weights(lay, torch.float32)
    lay.to(DEV)  # the processed weights beside x (a no-op on the CPU)
    # contiguous groups need no g_idx (the fast tile); sorted act-order neither (perm_k gathers x instead)
    assert (lay.g_idx_k is not None) == (act_order and not sort)
    assert (lay.perm_k is not None) == (act_order and sort)
    rl = torch.nn.Module()
    rl.int4, rl.bias, rl.weight = rec(), bias.clone(), None
    ref = NativeOps().linear_method(f"int4_{method}")
    ref.process_weights(rl, torch.float32)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    want = ref.apply(rl, x)
    order = lay.perm_k.cpu() if lay.perm_k is not None else torch.arange(k)
    dense = int4_dequantize(lay.qweight_nk, lay.zeros_ng, lay.scales_ng, lay.g_idx_k, group, torch.float32)
    assert torch.equal(dense.cpu(), rl.weight[:, order])
    assert torch.equal(TritonInt4Linear(method).dense_weight(lay).cpu(), rl.weight)
    paths = [{"dequant": False}, {"dequant": True}, {"dequant": False, "split": 3}]  # split: K blocks 3 + 3 + 2
    if m == 1 and lay.g_idx_k is None:  # the one-token GEMV (DEEPINFER_INT4_GEMV), contiguous groups only
        paths.append({"gemv": True})
    for path in paths:
        y = int4_gemm(x[:, order].to(DEV), lay.qweight_nk, lay.zeros_ng, lay.scales_ng, lay.g_idx_k, group, lay.bias,
                      **path)
        assert _rel(y.cpu(), want) < 1e-5, path
    assert _rel(TritonInt4Linear(method).apply(lay, x.to(DEV)).cpu(), want) < 1e-5  # (apply gathers x itself)


def test_int4_gemm_fp16_activations():
    """fp16 activations (the interpreter's stand-in for bf16, whose tl.dot and fp32 -> bf16 rounding it gets
    wrong): the tile is rounded to fp16 once, as the reference's dense fp16 weight."""
    from deepinfer.backends.nvidia.quant.int4_gemm import int4_gemm
    from deepinfer.backends.nvidia.quant.linear_methods import TritonInt4Linear

    rec = _int4_layer("awq", 48, 128, 64, 3)
    lay = torch.nn.Module()
    lay.int4, lay.bias, lay.weight = rec(), None, None
    TritonInt4Linear("awq").process_weights(lay, torch.float16)
    lay.to(DEV)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4)).half()
    y = int4_gemm(x.to(DEV), lay.qweight_nk, lay.zeros_ng, lay.scales_ng, None, 64)
    want = x.float() @ TritonInt4Linear("awq").dense_weight(lay).float().cpu().t()
    assert y.dtype == torch.float16 and _rel(y.cpu(), want) < 1e-3


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("m", [1, 21])
def test_int4_method_matches_native(method, m):
    from deepinfer.backend import Int4Weight
    from deepinfer.backends.nvidia.quant.linear_methods import TritonInt4Linear
    from deepinfer.checkpoints.awq_writer import pack_awq_cols, pack_gptq, quantize_int4

    g = torch.Generator().manual_seed(m)
    n, k = 48, 256
    q, z, s = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    if method == "awq":
        rec = lambda: Int4Weight("awq", pack_awq_cols(q), pack_awq_cols(z), s)  # noqa: E731
    else:
        qw, qz = pack_gptq(q, z)
        perm = torch.randperm(k, generator=g)  # an act-order g_idx: rows of every group scattered
        gidx = (perm // 128).to(torch.int32)
        rec = lambda: Int4Weight("gptq", qw, qz, s, gidx, zero_offset=1)  # noqa: E731
    x = torch.randn(m, k, generator=g)
    lay = torch.nn.Module()
    lay.int4, lay.bias, lay.weight = rec(), None, None
    ours = TritonInt4Linear(method)
    ours.process_weights(lay, torch.float32)
    lay.to(DEV)
    y = ours.apply(lay, x.to(DEV))
    rl = torch.nn.Module()
    rl.int4, rl.bias, rl.weight = rec(), None, None
    ref = NativeOps().linear_method(f"int4_{method}")
    ref.process_weights(rl, torch.float32)
    assert _rel(y.cpu(), ref.apply(rl, x)) < 1e-5
    torch.testing.assert_close(ours.dense_weight(lay).cpu(), rl.weight, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 256, 1024, 777])
@pytest.mark.parametrize("n,k", [(2048, 10944), (21888, 2048), (3072, 2048)])
def test_fp8_gemm_real_shapes(m, n, k):
    from deepinfer.backends.nvidia.quant.linear_methods import TritonFp8W8A8Linear

    g = torch.Generator().manual_seed(m)
    wq, ws = quantize_weight_fp8_block(torch.randn(n, k, generator=g) * k**-0.5)
    x = torch.randn(m, k, generator=g).bfloat16()
    lay = _layer(wq.cuda(), ws.cuda())
    meth = TritonFp8W8A8Linear()
    meth.process_weights(lay, torch.bfloat16)
    y = meth.apply(lay, x.cuda())
    ref = w8a8_block_linear_ref(x.float(), dequant_fp8_block(wq, ws))
    assert _rel(y.cpu(), ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 256, 777])
@pytest.mark.parametrize("n,k,group", [(3072, 2048, 128), (21888, 2048, 128), (2048, 10944, 64)])
def test_int4_gemm_real_shapes(m, n, k, group):
    """Both int4 paths in bf16 at V2-Lite shapes against the dequantized weight in fp32 (bf16 rounding only)."""
    from deepinfer.backends.nvidia.quant.int4_gemm import int4_dequantize, int4_gemm
    from deepinfer.backends.nvidia.quant.linear_methods import TritonInt4Linear

    rec = _int4_layer("awq", n, k, group, m)
    lay = torch.nn.Module()
    lay.int4, lay.bias, lay.weight = rec(), None, None
    lay.int4 = type(lay.int4)("awq", lay.int4.qweight.cuda(), lay.int4.qzeros.cuda(), lay.int4.scales.cuda(),
                              group_size=group)
    TritonInt4Linear("awq").process_weights(lay, torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
    w = int4_dequantize(lay.qweight_nk, lay.zeros_ng, lay.scales_ng, None, group, torch.float32)
    ref = x.float() @ w.t()
    for dequant in (False, True):
        y = int4_gemm(x, lay.qweight_nk, lay.zeros_ng, lay.scales_ng, None, group, dequant=dequant)
        assert _rel(y, ref) < 2e-2, dequant


@pytest.mark.parametrize("m,k", [(7, 300), (33, 256)])
def test_act_quant_writes_column_major_scales(m, k):
    """scales_col_major (cuBLAS's block-scaled layout, quant/fp8_cublas.py): the same values and scales, the scales
    as a [M, K/128] view with strides (1, M)."""
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8 as kq

    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3).to(DEV)
    q, s = kq(x)
    qc, sc = kq(x, scales_col_major=True)
    assert sc.shape == s.shape and sc.stride() == (1, m)
    assert torch.equal(sc, s) and torch.equal(qc.float(), q.float())
    qp, sp = kq(x, scales_col_major=True, pad_rows_to=16)  # cuBLAS's row alignment: zero rows past M
    mp = -(-m // 16) * 16
    assert qp.shape == (mp, k) and sp.shape == (mp, s.shape[1]) and sp.stride() == (1, mp)
    assert torch.equal(sp[:m], s) and torch.equal(qp[:m].float(), q.float()) and not qp[m:].float().any()


def test_cublas_fp8_path_is_taken_only_where_it_applies(monkeypatch):
    """Not on the CPU, not for the fused decode sizes, not when K is not a multiple of 128, not when turned off."""
    from deepinfer.backends.nvidia.quant.fp8_cublas import use_cublas

    w = torch.empty(256, 2048, dtype=torch.float8_e4m3fn)
    assert not use_cublas(torch.empty(256, 2048), w, fused_act_quant=False)  # CPU
    if torch.cuda.is_available():
        x, wd = torch.empty(256, 2048, device="cuda"), w.cuda()
        assert not use_cublas(x, wd, fused_act_quant=True)
        assert not use_cublas(torch.empty(256, 2000, device="cuda"),
                              torch.empty(256, 2000, dtype=torch.float8_e4m3fn, device="cuda"), fused_act_quant=False)
        monkeypatch.setenv("DEEPINFER_FP8_CUBLAS", "0")
        assert not use_cublas(x, wd, fused_act_quant=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS block-scaled fp8 needs the GPU")
@pytest.mark.parametrize("m,n,k", [(256, 3648, 2048), (777, 2048, 2048), (4096, 5632, 2048), (300, 2048, 2816)])
def test_fp8_w8a8_cublas_path_matches_native(m, n, k, monkeypatch):
    """V2-Lite-like shapes above the fused act-quant size: the cuBLAS block-scaled GEMM (taken on a Hopper
    GPU) against the native reference on the same quantized operands, at the bf16 tolerance; and against the
    Triton fp8 GEMM (DEEPINFER_FP8_CUBLAS=0). M 777: not a multiple of 16 (padded); K 2816: 22 scale blocks (padded
    to 24)."""
    from deepinfer.backends.nvidia.quant.fp8_cublas import use_cublas
    from deepinfer.backends.nvidia.quant.linear_methods import TritonFp8W8A8Linear

    g = torch.Generator().manual_seed(m)
    wq, ws = quantize_weight_fp8_block(torch.randn(n, k, generator=g) * k**-0.5)
    x = torch.randn(m, k, generator=g)
    lay = _layer(wq.clone().cuda(), ws.clone().cuda())
    ours = TritonFp8W8A8Linear()
    ours.process_weights(lay, torch.bfloat16)
    xb = x.cuda().bfloat16()
    assert use_cublas(xb, lay.weight, fused_act_quant=False) == (torch.cuda.get_device_capability() == (9, 0))
    y = ours.apply(lay, xb)
    r = w8a8_block_linear_ref(xb.float().cpu(), dequant_fp8_block(wq, ws))
    assert _rel(y.float().cpu(), r) < 2e-2
    monkeypatch.setenv("DEEPINFER_FP8_CUBLAS", "0")
    yt = ours.apply(lay, xb)
    assert _rel(y, yt) < 2e-2


def test_int4_gemv_is_taken_only_where_it_applies(monkeypatch):
    """DEEPINFER_INT4_GEMV: one token and contiguous groups (an act-order g_idx keeps the MMA path); off by default."""
    from deepinfer.backends.nvidia.quant.int4_gemm import use_gemv

    assert not use_gemv(1, None, None)
    monkeypatch.setenv("DEEPINFER_INT4_GEMV", "1")
    assert use_gemv(1, None, None) and not use_gemv(2, None, None)
    assert not use_gemv(1, torch.zeros(8, dtype=torch.int32), None)
    assert not use_gemv(1, None, False)
