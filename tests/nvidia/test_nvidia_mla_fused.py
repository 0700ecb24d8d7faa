"""The fused MLA pre-attention kernel (norm + RoPE + KV write + q_pe in place), the merged q/kv_a GEMM and the
copy-free decode path, against the op-by-op path they replace and the torch-native oracle."""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import DEVICE, ON_GPU, backend, mla_decode_ref, rel_err, tol  # noqa: I001  (sets TRITON_INTERPRET)

from deepinfer.backend import MLASpec
from deepinfer.backend.native import NativeOps
from deepinfer.backend.native.rope import rope_cos_sin_cache
from deepinfer.conformance.layer_cases import _mla_batch

YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
SPEC = MLASpec(num_heads=3, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
               softmax_scale=0.2)
PAGE = 4


def _inputs(t: int, dtype: torch.dtype, g: torch.Generator, extra_cols: int = 24):
    """q [T, H, nope+R] and kv_a [T, L+R] as views of one wider GEMM output (strided rows, as the model has)."""
    s = SPEC
    qw = s.num_heads * (s.qk_nope_head_dim + s.qk_rope_head_dim)
    kw = s.kv_lora_rank + s.qk_rope_head_dim
    buf = (torch.randn(t, qw + kw + extra_cols, generator=g) * 2).to(device=DEVICE, dtype=dtype)
    q = buf[:, :qw].view(t, s.num_heads, -1)
    kv_a = buf[:, qw : qw + kw]
    w = (torch.randn(s.kv_lora_rank, generator=g) * 0.5 + 1).to(device=DEVICE, dtype=dtype)
    pos = torch.randint(0, 256, (t,), generator=g).to(DEVICE)
    cs = rope_cos_sin_cache(s.qk_rope_head_dim, 256, 10000.0, YARN).to(DEVICE)
    return q, kv_a, w, pos, cs


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal under the interpreter; on the GPU two compiled kernels may reduce the RMS sum in another
    order (another warp layout), so within one unit of the dtype's precision there."""
    if not ON_GPU:
        return torch.equal(a, b)
    eps = torch.finfo(a.dtype).eps
    return torch.allclose(a.float(), b.float(), rtol=eps, atol=eps)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mla_prep_equals_separate_kernels_and_native(interleaved, dtype):
    """Bit-equal to rms_norm + rope + kv_write2 (same rounding points); close to the native ops; slot -1 skipped."""
    from deepinfer.backends.nvidia.kv_write import kv_cache_write_parts
    from deepinfer.backends.nvidia.mla_prep import mla_prep
    from deepinfer.backends.nvidia.rmsnorm import rms_norm
    from deepinfer.backends.nvidia.rope import rotary_embedding

    g = torch.Generator().manual_seed(11)
    s, t = SPEC, 6
    q, kv_a, w, pos, cs = _inputs(t, dtype, g)
    slots = torch.tensor([5, -1, 0, 17, 9, -1], device=DEVICE)
    cache0 = torch.randn(6, PAGE, s.cache_entry_dim, generator=g).to(device=DEVICE, dtype=dtype)
    L, R, nope = s.kv_lora_rank, s.qk_rope_head_dim, s.qk_nope_head_dim

    # op by op, as the model did before (Triton kernels)
    kv_c = rms_norm(kv_a[:, :L].contiguous(), w, 1e-6)
    q_pe, k_pe = rotary_embedding(pos, q[..., nope:].contiguous(), kv_a[:, L:].contiguous().view(t, 1, R), cs,
                                  interleaved)
    old_cache = cache0.clone()
    kv_cache_write_parts(old_cache, slots, kv_c, k_pe.view(t, R))
    old_q = torch.cat([q[..., :nope], q_pe], dim=-1)

    # torch-native oracle
    ops = NativeOps()
    n_kv = ops.rms_norm(kv_a[:, :L], w, 1e-6)
    n_qpe, n_kpe = ops.rotary_embedding(pos, q[..., nope:], kv_a[:, L:].reshape(t, 1, R), cs, interleaved)
    nat_cache = cache0.clone()
    ops.kv_cache_write(nat_cache, slots, torch.cat([n_kv, n_kpe.view(t, R)], -1))

    q_in = q.clone()
    new_cache = cache0.clone()
    mla_prep(q, kv_a, w, 1e-6, pos, cs, interleaved, new_cache, slots)
    assert _same(q, old_q)  # q_pe rotated in place, q_nope untouched
    assert _same(new_cache, old_cache)
    assert torch.equal(q[..., :nope], q_in[..., :nope])
    written = slots[slots >= 0]  # every other slot (the -1 rows' included) keeps its old entry
    untouched = torch.ones(cache0.numel() // s.cache_entry_dim, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(new_cache.view(-1, s.cache_entry_dim)[untouched], cache0.view(-1, s.cache_entry_dim)[untouched])
    atol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert torch.allclose(new_cache.float(), nat_cache.float(), atol=atol, rtol=atol)
    assert torch.allclose(q[..., nope:].float(), n_qpe.float(), atol=atol, rtol=atol)


def test_mla_prep_rejects_mismatched_shapes():
    from deepinfer.backends.nvidia.mla_prep import mla_prep
    from deepinfer.errors import BackendError

    g = torch.Generator().manual_seed(1)
    q, kv_a, w, pos, cs = _inputs(3, torch.float32, g)
    cache = torch.zeros(2, PAGE, 41, device=DEVICE)  # one column too wide
    with pytest.raises(BackendError, match="cache"):
        mla_prep(q, kv_a, w, 1e-6, pos, cs, True, cache, torch.zeros(3, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ctx,qlen", [
    ([3, 6, 0, 37], [5, 1, 4, 1]),  # mixed: prefill on a prefix, decode, fresh prefill, long decode
    ([9, 0, 70], [1, 1, 1]),  # decode only (the graph-captured path)
])
def test_forward_from_latent_matches_native_default(dtype, ctx, qlen):
    """TritonMLAAttention's fused override vs the base-class default run by the torch-native op."""
    g = torch.Generator().manual_seed(5)
    s = SPEC
    t = sum(qlen)
    num_blocks = sum(-(-(c + n) // PAGE) for c, n in zip(ctx, qlen)) + 2
    batch = _mla_batch(qlen, ctx, PAGE, num_blocks, g)
    batch = _to_device(batch)
    q, kv_a, w, _, cs = _inputs(t, dtype, g)
    kv_b = (torch.randn(s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank, generator=g) / 6)
    cache = torch.randn(num_blocks, PAGE, s.cache_entry_dim, generator=g).to(device=DEVICE, dtype=dtype)
    ours, ref = backend().make_mla_attention(s), NativeOps().make_mla_attention(s)
    ours.load_kv_b_proj(kv_b.to(device=DEVICE, dtype=dtype))
    ref.load_kv_b_proj(kv_b.to(device=DEVICE, dtype=dtype))
    c_ours, c_ref = cache.clone(), cache.clone()
    exp = ref.forward_from_latent(q.clone(), kv_a, w, 1e-6, batch.positions, cs, True, c_ref, batch, "mla",
                                  NativeOps())
    out = ours.forward_from_latent(q.clone(), kv_a, w, 1e-6, batch.positions, cs, True, c_ours, batch, "mla",
                                   backend())
    assert out.shape == (t, s.num_heads * s.v_head_dim) and out.dtype == dtype and out.is_contiguous()
    atol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert torch.allclose(c_ours.float(), c_ref.float(), atol=atol, rtol=atol)
    assert rel_err(out, exp) < 5 * tol(dtype)


def test_decode_writes_heads_contiguous_without_copies():
    """The copy-free decode (strided q, bmm into transposed views) equals the native absorbed decode."""
    g = torch.Generator().manual_seed(8)
    s = SPEC
    batch = _mla_batch([1, 1], [5, 12], PAGE, 8, g)
    batch = _to_device(batch)
    wide = torch.randn(2, s.num_heads * 24 + 7, generator=g).to(DEVICE)
    q = wide[:, : s.num_heads * 24].view(2, s.num_heads, 24)  # strided rows
    kv_b = torch.randn(s.num_heads * 32, s.kv_lora_rank, generator=g).to(DEVICE) / 6
    cache = torch.randn(8, PAGE, s.cache_entry_dim, generator=g).to(DEVICE)
    ours, ref = backend().make_mla_attention(s), NativeOps().make_mla_attention(s)
    ours.load_kv_b_proj(kv_b)
    ref.load_kv_b_proj(kv_b)
    out = ours.decode(q, cache, batch.block_tables["mla"], batch.seq_lens)
    assert out.is_contiguous() and out.shape == (2, s.num_heads, s.v_head_dim)
    for i, n in enumerate((6, 13)):
        from deepinfer.backend.native.mla_attention import gather_context

        lat = gather_context(cache, batch.block_tables["mla"][i], n)
        assert rel_err(out[i], ref.decode(q[i : i + 1].float(), lat)[0]) < 1e-5


@pytest.mark.parametrize("quantized", [False, True])
def test_q_and_kv_a_projections_run_as_one_gemm(quantized):
    """V2-Lite shapes (q_lora_rank None): q_proj [3072, 2048] + kv_a_proj_with_mqa [576, 2048] fuse, fp8 included."""
    from deepinfer.models.layers.linear import MergedLinear

    g = torch.Generator().manual_seed(3)
    ops = backend()
    D, sizes = 256, [3 * 128, 72]  # scaled down; the q part fills whole 128-row fp8 blocks as 3072 does
    ml = MergedLinear(D, sizes, ops, torch.float32, biases=[False, True], quantized=quantized)
    loaders = ml.loaders(["a.q_proj", "a.kv_a_proj_with_mqa"])
    weights = {}
    for n, o in zip(("a.q_proj", "a.kv_a_proj_with_mqa"), sizes):
        w = torch.randn(o, D, generator=g) * 0.1
        if quantized:
            weights[f"{n}.weight"] = w.to(torch.float8_e4m3fn)
            weights[f"{n}.weight_scale_inv"] = torch.rand(-(-o // 128), D // 128, generator=g) + 0.5
        else:
            weights[f"{n}.weight"] = w
    weights["a.kv_a_proj_with_mqa.bias"] = torch.randn(sizes[1], generator=g)
    for name, t in weights.items():
        loaders[name](t)
    parts = [p.weight.float().cpu() for p in ml.parts]
    if quantized:
        from deepinfer.backend.native.linear import dequant_fp8_block

        parts = [dequant_fp8_block(p.weight, p.weight_scale_inv).cpu() for p in ml.parts]
    ml.finalize()
    assert ml.fused is not None  # one GEMM
    x = torch.randn(5, D, generator=g).to(DEVICE)
    q, kv = ml(x).cpu().split(sizes, dim=-1)
    x = x.cpu()
    assert torch.allclose(q, x @ parts[0].T, atol=1e-4)
    assert torch.allclose(kv, x @ parts[1].T + weights["a.kv_a_proj_with_mqa.bias"], atol=1e-4)


@pytest.mark.parametrize("splits,min_split", [(1, 16), (4, 16), (8, 32), (16, 16)])
def test_mla_decode_adaptive_splits_and_direct_write(splits, min_split):
    """Per-sequence split sizes (short rows use fewer splits, a padded row of length 0 gives zeros), the
    one-split direct write, and the tiled merge: all equal the float64 reference, and repeat bit for bit."""
    from deepinfer.backends.nvidia.mla_decode import mla_decode

    g = torch.Generator().manual_seed(9)
    L, R = 32, 16
    cache = torch.randn(40, PAGE, L + R, generator=g).to(DEVICE)
    table = torch.randperm(40, generator=g)[:36].view(3, 12).int().to(DEVICE)
    seq = torch.tensor([45, 3, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 5, L + R, generator=g).to(DEVICE)
    out = mla_decode(q, cache, table, seq, L, 0.2, num_splits=splits, block_n=16, min_split=min_split)
    again = mla_decode(q, cache, table, seq, L, 0.2, num_splits=splits, block_n=16, min_split=min_split)
    assert torch.equal(out, again)
    exp = mla_decode_ref(q, cache, table, seq, L, 0.2)
    assert torch.equal(out[2].cpu(), torch.zeros_like(out[2].cpu()))
    assert rel_err(out[:2].cpu(), exp[:2]) < 1e-5


def test_decode_params_heuristic_and_env_overrides(monkeypatch):
    """The launch shape depends on host sizes only; env overrides win and bad values name the variable."""
    from deepinfer.backends.nvidia import mla_decode as md
    from deepinfer.errors import ConfigError

    md.env_overrides.cache_clear()
    try:
        p1, p64, p256 = (md.decode_params(b, 16, 163840) for b in (1, 64, 256))
        assert (p1.num_splits, p1.min_split, p1.block_n, p1.num_warps) == (64, 64, 64, 8)
        assert (p64.num_splits, p64.min_split, p64.block_n, p64.num_stages) == (4, 32, 32, 2)  # long tables
        short = md.decode_params(64, 16, 2064)  # max_model_len ~2k: 4 splits of 32-token tiles, 3 stages
        assert (short.num_splits, short.min_split, short.block_n, short.num_stages) == (4, 32, 32, 3)
        assert (p256.num_splits, p256.block_n, p256.num_stages) == (1, 32, 3)  # one split: no merge launch
        assert md.decode_params(16, 16, 300).num_splits == 3  # an eager batch of short rows: capped by the table
        monkeypatch.setenv("DEEPINFER_MLA_SPLITS", "3")
        monkeypatch.setenv("DEEPINFER_MLA_BLOCK_N", "64")
        monkeypatch.setenv("DEEPINFER_MLA_MIN_SPLIT", "100")
        md.env_overrides.cache_clear()
        p = md.decode_params(64, 16, 163840)
        assert (p.num_splits, p.block_n, p.min_split) == (3, 64, 128)
        monkeypatch.setenv("DEEPINFER_MLA_BLOCK_N", "48")
        md.env_overrides.cache_clear()
        with pytest.raises(ConfigError, match="DEEPINFER_MLA_BLOCK_N"):
            md.decode_params(1, 16, 1024)
    finally:
        md.env_overrides.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 17])
def test_mla_prep_absorbs_q_nope_through_w_uk(dtype, t):
    """The decode launch's extra programs: q_lat = q_nope @ W_UK per head (token blocks of 16, 128-column
    blocks, a non-power-of-two nope width), equal to the batched GEMM it replaces; the prep part unchanged."""
    from deepinfer.backends.nvidia.mla_prep import mla_prep

    g = torch.Generator().manual_seed(4)
    h, nope, r, L = 3, 24, 8, 256
    to = dict(device=DEVICE, dtype=dtype)
    q = torch.randn(t, h, nope + r, generator=g).to(**to)
    kv_a = torch.randn(t, L + r, generator=g).to(**to)
    w = torch.ones(L, **to)
    w_uk = (torch.randn(h, nope, L, generator=g) / 5).to(**to)
    pos = torch.arange(t, device=DEVICE)
    cs = rope_cos_sin_cache(r, 64, 10000.0, None).to(DEVICE)
    slots = torch.arange(t, device=DEVICE)
    c1, c2 = torch.zeros(5, PAGE, L + r, **to), torch.zeros(5, PAGE, L + r, **to)
    q1, q2 = q.clone(), q.clone()
    assert mla_prep(q1, kv_a, w, 1e-6, pos, cs, True, c1, slots) is None
    q_lat = mla_prep(q2, kv_a, w, 1e-6, pos, cs, True, c2, slots, w_uk=w_uk)
    assert _same(q1, q2) and _same(c1, c2)  # the absorb programs change nothing else
    exp = torch.bmm(q[..., :nope].transpose(0, 1).float(), w_uk.float()).transpose(0, 1)
    assert q_lat.shape == (t, h, L) and q_lat.dtype == dtype
    assert rel_err(q_lat, exp) < tol(dtype)


def test_fused_absorb_equals_batched_gemm_path():
    """forward_from_latent on a decode batch: absorb in the prep launch vs the cuBLAS bmm, same result."""
    g = torch.Generator().manual_seed(12)
    s = SPEC
    batch = _mla_batch([1, 1, 1], [4, 30, 0], PAGE, 14, g)
    q, kv_a, w, _, cs = _inputs(3, torch.float32, g)
    kv_b = torch.randn(s.num_heads * 32, s.kv_lora_rank, generator=g).to(DEVICE) / 6
    outs = []
    for fused in (True, False):
        op = backend().make_mla_attention(s)
        op.fuse_absorb = fused
        op.load_kv_b_proj(kv_b)
        cache = torch.zeros(14, PAGE, s.cache_entry_dim, device=DEVICE)
        outs.append(op.forward_from_latent(q.clone(), kv_a, w, 1e-6, batch.positions.to(DEVICE), cs, True, cache,
                                           _to_device(batch), "mla", backend()))
    assert rel_err(outs[0], outs[1]) < 1e-6


def _to_device(batch):
    return type(batch)(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else
                              {n: x.to(DEVICE) for n, x in v.items()} if isinstance(v, dict) else v)
                          for k, v in batch.__dict__.items() if k != "derived"})


@pytest.mark.parametrize("batch,splits", [(2, 4), (9, 4), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_with_w_uv(batch, splits, dtype):
    """W_UV applied in the merge launch (batch <= MERGE_UV_MAX_BATCH) or by a batched GEMM after it (larger
    batches, or one split): both equal o_lat @ W_UV^T, o_lat rounded to the dtype first as before."""
    from deepinfer.backends.nvidia.mla_decode import MERGE_UV_MAX_BATCH, mla_decode

    assert MERGE_UV_MAX_BATCH < 9
    g = torch.Generator().manual_seed(21)
    L, R, V, h = 32, 16, 40, 3  # V = 40: two 32-column blocks, the second masked
    to = dict(device=DEVICE, dtype=dtype)
    blocks = batch * 6
    cache = torch.randn(blocks, PAGE, L + R, generator=g).to(**to)
    table = torch.randperm(blocks, generator=g).view(batch, 6).int().to(DEVICE)
    seq = torch.randint(0, 24, (batch,), generator=g).int().to(DEVICE)
    q = torch.randn(batch, h, L + R, generator=g).to(**to)
    w_uv_t = (torch.randn(h, L, V, generator=g) / 4).to(**to)
    o_lat = mla_decode(q, cache, table, seq, L, 0.2, num_splits=splits, block_n=16, min_split=16)
    out = mla_decode(q, cache, table, seq, L, 0.2, num_splits=splits, block_n=16, min_split=16, w_uv_t=w_uv_t)
    exp = torch.einsum("bhl,hlv->bhv", o_lat.double(), w_uv_t.double())
    assert out.shape == (batch, h, V) and out.dtype == dtype and out.is_contiguous()
    assert rel_err(out, exp) < tol(dtype)


@pytest.mark.parametrize("tile", ["16,16,1", "64,32,2"])
def test_mla_decode_with_w_uv_other_merge_tiles(tile, monkeypatch):
    """DEEPINFER_MLA_MERGE_UV_TILE (BLOCK_V, BLOCK_LC, num_warps) changes how the merge + W_UV programs split
    the work, not the result: the same o_lat @ W_UV^T within fp32 tolerance (BLOCK_LC 16: the latent in two
    chunks; BLOCK_V 64: every column in one program, masked past V)."""
    from deepinfer.backends.nvidia.mla_decode import merge_uv_tile, mla_decode

    monkeypatch.setenv("DEEPINFER_MLA_MERGE_UV_TILE", tile)
    assert merge_uv_tile(32, 40) == tuple(min(v, c) for v, c in zip(map(int, tile.split(",")), (64, 32, 32)))
    g = torch.Generator().manual_seed(22)
    L, R, V, h, batch = 32, 16, 40, 3, 2
    to = {"device": DEVICE, "dtype": torch.float32}
    cache = torch.randn(batch * 6, PAGE, L + R, generator=g).to(**to)
    table = torch.randperm(batch * 6, generator=g).view(batch, 6).int().to(DEVICE)
    seq = torch.tensor([23, 9]).int().to(DEVICE)
    q = torch.randn(batch, h, L + R, generator=g).to(**to)
    w_uv_t = (torch.randn(h, L, V, generator=g) / 4).to(**to)
    o_lat = mla_decode(q, cache, table, seq, L, 0.2, num_splits=4, block_n=16, min_split=16)
    out = mla_decode(q, cache, table, seq, L, 0.2, num_splits=4, block_n=16, min_split=16, w_uv_t=w_uv_t)
    assert rel_err(out, torch.einsum("bhl,hlv->bhv", o_lat.double(), w_uv_t.double())) < tol(torch.float32)


def test_merge_uv_default_tile_follows_the_split_rows(monkeypatch):
    """The default: the whole 512-wide latent a chunk up to 32 split rows (the H100 sweep's best, 8 warps at 32),
    256-wide at 64 (a [splits, chunk] fp32 tile of at most 16,384, 8 warps where it is full); small widths capped."""
    from deepinfer.backends.nvidia.mla_decode import merge_uv_tile

    monkeypatch.delenv("DEEPINFER_MLA_MERGE_UV_TILE", raising=False)
    assert merge_uv_tile(512, 128, 32) == (32, 512, 8)
    assert merge_uv_tile(512, 128, 64) == (32, 256, 8)
    assert merge_uv_tile(512, 128, 16) == (32, 512, 4)  # a half-full tile: four warps
    assert merge_uv_tile(32, 40, 4) == (32, 32, 4)


@pytest.mark.parametrize("value", ["32,64", "32,48,4", "a,b,c", "32,64,64", "32,128,4"])
def test_merge_uv_tile_env_refuses_bad_values(value, monkeypatch):
    """A malformed tile names the variable (three powers of two, num_warps <= 32, BLOCK_LC dividing L = 64)."""
    from deepinfer.backends.nvidia.mla_decode import merge_uv_tile
    from deepinfer.errors import BackendError

    monkeypatch.setenv("DEEPINFER_MLA_MERGE_UV_TILE", value)
    if value == "32,128,4":  # a chunk wider than L is capped at L, not refused
        assert merge_uv_tile(64, 128) == (32, 64, 4)
        return
    with pytest.raises(BackendError, match="DEEPINFER_MLA_MERGE_UV_TILE"):
        merge_uv_tile(64, 128)


@pytest.mark.slow
def test_tiny_v2_lite_model_through_fused_path_matches_native():
    """Whole tiny V2-Lite (q_lora_rank None: merged q/kv_a GEMM, mla_prep with the absorb, merge + W_UV) on
    the NVIDIA backend vs NativeOps: chunked prefill on a cached prefix, then teacher-forced decode (fp32)."""
    from deepinfer.conformance.runner import run_conformance

    report = run_conformance(backend(), ops=[], dtypes=[torch.float32], models=("tiny-v2-lite",))
    assert report.ok and [r.status for r in report.rows] == ["pass"], report.format_table()
