"""The router GEMVs behind router_logits (per-token at 1 token, token-tiled at 2..64) against an fp64
reference: fp32 products and sums, so logits within 1e-6 and the same top-k experts; the same bits on
every call; DEEPINFER_ROUTER_GEMV parsing. Tiny shapes under the interpreter, real ones on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from nvidia_testutil import DEVICE, ON_GPU, rel_err  # noqa: I001  (sets TRITON_INTERPRET)

from deepinfer.errors import BackendError

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKENS = (1, 2, 5, 16, 17, 63, 64)


def _inputs(t: int, e: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    gate = (torch.randn(e, d, generator=g) / d**0.5).to(DEVICE)
    return x, gate


def _reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), gate.double()).float()  # the values the kernel multiplies, summed in fp64


def _check(t: int, e: int, d: int, dtype: torch.dtype, seed: int = 0, twice: bool = ON_GPU) -> torch.Tensor:
    from deepinfer.backends.nvidia.moe_routing import router_logits

    x, gate = _inputs(t, e, d, dtype, seed)
    out = router_logits(x, gate)
    ref = _reference(x, gate)
    assert out.dtype == torch.float32 and out.shape == (t, e)
    assert rel_err(out, ref) < 1e-6
    if twice:  # no atomics, no run-time split choice: the same bits on every call
        assert torch.equal(router_logits(x, gate), out)
    _same_top_experts(out, ref)
    return out


def _same_top_experts(out: torch.Tensor, ref: torch.Tensor, k: int = 6) -> None:
    """Same top-k ids in the same order, on every token whose k + 1 best reference logits are apart by more
    than fp32 rounding (a near-tie may go either way in any fp32 sum)."""
    vals, ids = ref.topk(k + 1, dim=-1)
    clear = (vals[:, :-1] - vals[:, 1:]).min(-1).values > 1e-5 * ref.abs().amax()
    assert clear.float().mean() >= 0.9
    assert torch.equal(out.topk(k, dim=-1).indices[clear], ids[clear, :k])


# Interpreter: E = 67 (a partial expert block), D = 300 (a partial D chunk), every token count's tile.
@pytest.mark.parametrize("t", TOKENS)
def test_router_logits_match_fp64_reference(t):
    _check(t, 67, 300, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t", [1, 17])
def test_router_logits_fp32_and_fp16_inputs(dtype, t):
    _check(t, 64, 300, dtype, seed=1)


@pytest.mark.parametrize("t, d", [(64, 600), (16, 2100)])
def test_default_tile_loops_over_d_with_a_tail(t, d):
    """The default tiles' D loop: 64 tokens step 256 (600 = 2 x 256 + 88), 16 tokens 1024 (2100 = 2 x 1024 + 52)."""
    from deepinfer.backends.nvidia.moe_routing import _tiled_gemv_tile

    assert _tiled_gemv_tile(t, 64, d)[2] < d / 2
    _check(t, 64, d, torch.bfloat16, seed=4)


@pytest.mark.parametrize("tile", ["4,8,128,4", "2,4,64,2,2", "16,2,128,4,1", "8,1,512,1"])
def test_tiled_gemv_tile_override_and_tails(monkeypatch, tile):
    """Tiles that leave partial token, expert and D blocks (17 = 4x4 + 1, 11 = 8 + 3, 300 = 2x128 + 44)."""
    monkeypatch.setenv("DEEPINFER_ROUTER_GEMV", tile)
    _check(17, 11, 300, torch.bfloat16, seed=2, twice=True)


def test_per_token_override_keeps_the_old_gemv(monkeypatch):
    """A 3-value DEEPINFER_ROUTER_GEMV routes every size through the per-token GEMV (the A/B)."""
    from deepinfer.backends.nvidia.moe_routing import _gemv_tile, _tiled_gemv_tile

    monkeypatch.setenv("DEEPINFER_ROUTER_GEMV", "4,128,2")
    assert _gemv_tile(300) == (4, 128, 2)
    _check(5, 67, 300, torch.float16, seed=3)
    monkeypatch.setenv("DEEPINFER_ROUTER_GEMV", "8,4,256,8")
    assert _tiled_gemv_tile(64, 64, 2048) == (8, 4, 256, 8, 4)  # default stages
    assert _gemv_tile(2048) == _gemv_tile(2048, 16) == (1, 512, 1)  # the per-token GEMV keeps its defaults: to 16
    assert _gemv_tile(2048, 17) == (2, 1024, 4)  # tokens, and past
    monkeypatch.setenv("DEEPINFER_ROUTER_GEMV", "8,4,256,8,2")
    assert _tiled_gemv_tile(64, 64, 2048) == (8, 4, 256, 8, 2)


def test_default_tiles_fill_the_gpu_and_share_rows():
    """Token-tiled at V2-Lite / V3 shapes: about one program per SM, gate chunks shared by several tokens."""
    import triton

    from deepinfer.backends.nvidia.moe_routing import TILED_MIN_PROGRAMS, _tiled_gemv_tile

    for e, d in ((64, 2048), (256, 7168)):
        for t in range(2, 65):
            bt, be, bd, warps, stages = _tiled_gemv_tile(t, e, d)
            programs = -(-t // bt) * -(-e // be)
            assert programs >= min(TILED_MIN_PROGRAMS, t * e) and bd <= d and bt <= triton.next_power_of_2(t)
            assert bt * be * bd <= 64 * 32 * warps  # <= 64 fp32 accumulators per thread
    assert _tiled_gemv_tile(64, 64, 2048) == (8, 4, 256, 4, 4)


@pytest.mark.parametrize("value, problem", [
    ("x", "comma-separated integers"), ("8,4", "2 values"), ("1,2,3,4,5,6", "6 values"),
    ("8,3,256,4", "powers of two"), ("0,4,256,4", "powers of two"), ("8,4,256,3", "num_warps"),
    ("8,4,256,64", "num_warps must be <= 32"), ("8,4,256,4,0", "num_stages"), ("2,1000,4", "powers of two"),
])
def test_bad_router_gemv_env_names_the_variable(monkeypatch, value, problem):
    from deepinfer.backends.nvidia.moe_routing import _gemv_tile, _tiled_gemv_tile, router_logits

    monkeypatch.setenv("DEEPINFER_ROUTER_GEMV", value)
    for call in (lambda: _gemv_tile(2048), lambda: _tiled_gemv_tile(64, 64, 2048),
                 lambda: router_logits(*_inputs(3, 8, 16, torch.float32))):
        with pytest.raises(BackendError, match="DEEPINFER_ROUTER_GEMV") as info:
            call()
        assert problem in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="real shapes need the GPU (the interpreter is too slow)")
@pytest.mark.parametrize("dtype, e, d", [
    *((dt, e, d) for dt in DTYPES for e, d in ((64, 2048), (67, 2048), (64, 300), (67, 300))),
    (torch.bfloat16, 256, 7168),  # V3 in its serving dtype only: each dtype's compiles cost test time
])
def test_router_logits_real_shapes(dtype, e, d):
    """V2-Lite (64 x 2048), partial blocks, and V3 (256 x 7168)."""
    for t in TOKENS:
        for seed in range(2):
            _check(t, e, d, dtype, seed)


def test_router_bench_dry_run(monkeypatch, capsys):
    """benchmarks.kernels --only router's code paths on the CPU (each timing is a single call): the GPU run
    that times them should not be the first place a typo shows up."""
    if ON_GPU:
        pytest.skip("the GPU runs the real benchmark")
    from benchmarks import kernels

    monkeypatch.setattr(kernels, "DEV", "cpu")
    monkeypatch.setattr(kernels, "ROWS", [])
    kernels.router_bench(tokens_list=(2,), tiles=(None, "2,1024,4", "3,3,3,3"))
    out = capsys.readouterr().out
    assert "router logits, dry-run gate 8 x 256" in out and "T=2: 1,1,256,4,4" in out  # kernels.DRY_RUN_ROUTER_GATE
    rows = [r for r in kernels.ROWS if r["name"] == "router_logits"]
    assert all(r["deterministic"] and r["max_abs_err"] < 1e-5 for r in rows if "ms" in r)
    assert [r["tile"] for r in rows if "error" in r] == ["3,3,3,3"]  # a bad tile is a result row
    assert all(r["same_ids"] for r in kernels.ROWS if r["name"] == "router+topk")
