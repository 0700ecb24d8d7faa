"""fp8 KV cache in the NVIDIA backend's Triton MLA kernels (KV write, the fused prep, split-KV decode, the layer
with prefill) against the torch reference on the same fp8 cache: under TRITON_INTERPRET=1 at tiny shapes on the
CPU, and at DeepSeek-V3 shapes on the GPU (the `gpu` test)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined
pytest.importorskip("triton", reason="triton is not installed")

from test_kv_cache_fp8 import _batch  # the batch builder of the CPU tests

from deepinfer.backend import MLASpec, NativeMLAAttention
from deepinfer.backend.kv_spec import dequantize_kv, quantize_kv
from deepinfer.backend.native import NativeOps
from deepinfer.backend.native.rope import rope_cos_sin_cache

FP8 = torch.float8_e4m3fn
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SPEC = MLASpec(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=32,
               softmax_scale=0.17)
PAGE = 4


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _on(batch):
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.init}
    for k, v in moved.items():
        if isinstance(v, torch.Tensor):
            moved[k] = v.to(DEVICE)
        elif isinstance(v, dict):
            moved[k] = {g: t.to(DEVICE) for g, t in v.items()}
    return type(batch)(**moved)


def _inputs(spec: MLASpec, ctx, qlen, num_blocks, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    batch = _on(_batch(ctx, qlen, num_blocks, g))
    t, e = sum(qlen), spec.cache_entry_dim
    context = (torch.randn(num_blocks, PAGE, e, generator=g) * 2).to(DEVICE)
    q = torch.randn(t, spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim, generator=g)
    kv_a = torch.randn(t, e, generator=g) * 2
    kv_a[0, :2] = torch.tensor([900.0, -3e-4])  # beyond ±448 (after the norm: still large) and subnormal-small
    w = torch.randn(spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank, generator=g) / 6
    norm_w = 1 + 0.1 * torch.randn(spec.kv_lora_rank, generator=g)
    return batch, context, q.to(DEVICE, dtype), kv_a.to(DEVICE, dtype), w.to(DEVICE, dtype), norm_w.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.375])
def test_kv_write_parts_fp8_bitwise(dtype, scale):
    """kv_cache_write_parts into an fp8 cache stores exactly quantize_kv(kv_c || k_pe) (clamp, rounding,
    subnormals, signed zeros); padded rows (slot -1) write nothing."""
    from deepinfer.backends.nvidia.kv_write import kv_cache_write_parts

    g = torch.Generator().manual_seed(0)
    t, L, R = 9, 32, 16
    a = (torch.randn(t, L, generator=g) * 60).to(DEVICE, dtype)
    b = (torch.randn(t, R, generator=g) * 0.004).to(DEVICE, dtype)
    a[0, :3] = torch.tensor([1000.0, -1000.0, -0.0])
    slots = torch.tensor([5, 0, -1, 17, 3, 8, 11, 2, 30], device=DEVICE)
    cache = torch.zeros(8, PAGE, L + R, dtype=FP8, device=DEVICE)
    kv_cache_write_parts(cache, slots, a, b, scale)
    keep = slots >= 0
    want = quantize_kv(torch.cat([a, b], -1), FP8, scale)[keep]
    flat = cache.view(-1, L + R)
    assert torch.equal(_bits(flat[slots[keep]]), _bits(want))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[keep]] = False
    assert not bool(_bits(flat[untouched]).any())


@pytest.mark.parametrize("scale", [1.0, 0.375])
def test_mla_prep_fp8_bitwise(scale):
    """The fused norm + RoPE + write kernel stores in fp8 exactly what it stores in fp32, quantized (quantize_kv),
    and rotates q the same; so fp8 adds no rounding point of its own."""
    from deepinfer.backends.nvidia.mla_prep import mla_prep

    s = SPEC
    batch, _, q, kv_a, _, norm_w = _inputs(s, [3, 0], [2, 4], 8, torch.float32)
    cs = rope_cos_sin_cache(s.qk_rope_head_dim, 64, 10000.0, None).to(DEVICE)
    slots = batch.slot_mapping["mla"]
    full = torch.zeros(8, PAGE, s.cache_entry_dim, device=DEVICE)
    fp8 = torch.zeros(8, PAGE, s.cache_entry_dim, dtype=FP8, device=DEVICE)
    q1, q2 = q.clone(), q.clone()
    mla_prep(q1, kv_a, norm_w, 1e-6, batch.positions, cs, True, full, slots)
    mla_prep(q2, kv_a, norm_w, 1e-6, batch.positions, cs, True, fp8, slots, kv_scale=scale)
    assert torch.equal(q1, q2)
    assert torch.equal(_bits(fp8), _bits(quantize_kv(full, FP8, scale)))


def _native(spec, w, scale):
    op = NativeMLAAttention(spec)
    op.load_kv_b_proj(w)
    op.load_kv_scale(scale)
    return op


def _triton(spec, w, scale):
    from deepinfer.backends.nvidia.mla_attention import TritonMLAAttention

    op = TritonMLAAttention(spec)
    op.load_kv_b_proj(w)
    op.load_kv_scale(scale)
    return op


def _rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("scale", [1.0, 0.375])
@pytest.mark.parametrize("ctx,qlen", [
    ([3, 6, 0, 21], [5, 1, 4, 1]),  # prefill on an fp8 prefix, decode, fresh prefill, decode
    ([9, 0, 26], [1, 1, 1]),  # decode only: the fused prep + absorb, split-KV with the fused W_UV merge
])
def test_triton_layer_matches_native_on_fp8_cache(ctx, qlen, scale):
    """TritonMLAAttention.forward_from_latent over an fp8 cache vs the native op over the same fp8 cache (fp32
    compute): the caches end bitwise equal and the outputs agree to fp32 rounding."""
    s = SPEC
    batch, context, q, kv_a, w, norm_w = _inputs(s, ctx, qlen, 24, torch.float32)
    cs = rope_cos_sin_cache(s.qk_rope_head_dim, 64, 10000.0, None).to(DEVICE)
    caches = [quantize_kv(context, FP8, scale) for _ in range(2)]
    ops = NativeOps()
    tri = _triton(s, w, scale).forward_from_latent(q.clone(), kv_a, norm_w, 1e-6, batch.positions, cs, True,
                                                   caches[0], batch, "mla", ops)
    ref = _native(s, w, scale).forward_from_latent(q.clone(), kv_a, norm_w, 1e-6, batch.positions, cs, True,
                                                   caches[1], batch, "mla", ops)
    assert torch.equal(_bits(caches[0]), _bits(caches[1]))
    assert _rel(tri, ref) < 2e-5


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_fp8_vs_dequantized(splits):
    """mla_decode reading fp8 (converted in registers, scale folded into scores and outputs) equals mla_decode on
    the dequantized fp32 cache, one split (direct) or three (partials + merge)."""
    from deepinfer.backends.nvidia.mla_decode import mla_decode

    g = torch.Generator().manual_seed(7)
    B, H, L, R = 3, 4, 32, 16
    stored = quantize_kv((torch.randn(12, PAGE, L + R, generator=g) * 3), FP8, 0.375).to(DEVICE)
    table = torch.randperm(12, generator=g)[:12].view(3, 4).int().to(DEVICE)
    seq = torch.tensor([13, 1, 16], dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, H, L + R, generator=g).to(DEVICE)
    got = mla_decode(q, stored, table, seq, L, 0.2, num_splits=splits, block_n=16, kv_scale=0.375)
    want = mla_decode(q, dequantize_kv(stored, 0.375), table, seq, L, 0.2, num_splits=splits, block_n=16)
    assert _rel(got, want) < 2e-6


@pytest.mark.parametrize("q_scale", [1.0, 1e5, 1e-3])
def test_mla_decode_fp8_fp16_dots(monkeypatch, q_scale):
    """DEEPINFER_MLA_FP8_KV_DOT=fp16: bf16 q against the e4m3 cache in fp16 dots, q scaled by a power of two into
    fp16's range. Against the fp32 oracle on the dequantized cache it is within the bf16 output's rounding, as
    close as the default path (which the interpreter runs in fp32) to within 4e-3, for q of unit size, of 1e5
    (past fp16's 65504: unscaled it would be inf) and of 1e-3. Mutations tried: the scale left out of the scores
    fails all three; no scaling at all fails the 1e5 case."""
    from deepinfer.backends.nvidia.mla_decode import mla_decode

    g = torch.Generator().manual_seed(11)
    B, H, L, R = 3, 4, 32, 16
    stored = quantize_kv((torch.randn(12, PAGE, L + R, generator=g) * 3), FP8, 0.375).to(DEVICE)
    table = torch.randperm(12, generator=g)[:12].view(3, 4).int().to(DEVICE)
    seq = torch.tensor([13, 1, 16], dtype=torch.int32, device=DEVICE)
    q32 = torch.randn(B, H, L + R, generator=g) * q_scale
    q = q32.to(torch.bfloat16).to(DEVICE)
    scale = 0.2 / q_scale  # softmax logits of unit size whatever q's
    want = mla_decode(q.float(), dequantize_kv(stored, 0.375), table, seq, L, scale, num_splits=3, block_n=16)
    monkeypatch.setenv("DEEPINFER_MLA_FP8_KV_DOT", "bf16")
    bf16 = mla_decode(q, stored, table, seq, L, scale, num_splits=3, block_n=16, kv_scale=0.375)
    monkeypatch.setenv("DEEPINFER_MLA_FP8_KV_DOT", "fp16")
    got = mla_decode(q, stored, table, seq, L, scale, num_splits=3, block_n=16, kv_scale=0.375)
    assert got.dtype == torch.bfloat16
    assert _rel(got.float(), want) <= max(_rel(bf16.float(), want), 4e-3)
    assert _rel(got.float(), want) < 8e-3  # bf16 output rounding (2^-9) and fp16 probabilities
    monkeypatch.setenv("DEEPINFER_MLA_FP8_KV_DOT", "fp32")
    with pytest.raises(Exception, match="DEEPINFER_MLA_FP8_KV_DOT"):
        mla_decode(q, stored, table, seq, L, scale, num_splits=3, block_n=16, kv_scale=0.375)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dot", ["bf16", "fp16"])  # DEEPINFER_MLA_FP8_KV_DOT: the decode's dots
@pytest.mark.parametrize("ctx,qlen", [([300, 0, 1500, 37], [64, 200, 1, 1]), ([511, 2047, 5, 900] * 4, [1] * 16)])
def test_fp8_layer_v3_shapes_gpu(ctx, qlen, dot, monkeypatch):
    """DeepSeek-V3 shapes (16 local heads, latent 512, rope 64), bf16 compute, an fp8 cache: the Triton layer's
    writes match the reference's (>99% the same bytes, the rest one e4m3 step) and its output is within bf16
    error of the fp32 oracle on the same cache, with the decode's dots in bf16 (default) or fp16."""
    monkeypatch.setenv("DEEPINFER_MLA_FP8_KV_DOT", dot)
    spec = MLASpec(num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                   softmax_scale=0.1147)
    num_blocks = sum(-(-(c + n) // PAGE) for c, n in zip(ctx, qlen)) + 8
    batch, context, q, kv_a, w, norm_w = _inputs(spec, ctx, qlen, num_blocks, torch.bfloat16)
    cs = rope_cos_sin_cache(spec.qk_rope_head_dim, 4096, 10000.0, None).to(DEVICE)
    caches = [quantize_kv(context, FP8) for _ in range(2)]
    ops = NativeOps()
    tri = _triton(spec, w, 1.0).forward_from_latent(q.clone(), kv_a, norm_w, 1e-6, batch.positions, cs, True,
                                                    caches[0], batch, "mla", ops)
    ref = _native(spec, w, 1.0).forward_from_latent(q.clone(), kv_a, norm_w, 1e-6, batch.positions, cs, True,
                                                    caches[1], batch, "mla", ops)
    # bf16 norm / RoPE on the GPU round like the native ops up to an ulp (test_nvidia_mla_fused), so an entry
    # may land one e4m3 step (1/8 relative) away; nearly all are the same bytes
    written = batch.slot_mapping["mla"]
    a, b = (c.view(-1, spec.cache_entry_dim)[written] for c in caches)
    same = _bits(a) == _bits(b)
    assert float(same.float().mean()) > 0.99
    torch.testing.assert_close(a.float(), b.float(), rtol=0.13, atol=2.0**-9)
    assert _rel(tri, ref) < 2e-2
