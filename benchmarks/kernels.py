"""Kernel microbenchmarks on the GPU at DeepSeek-V2-Lite shapes (JSON lines + a table).

- MLA decode: effective bandwidth (latent cache bytes read / time) at batch 64,
  4k context, for a few tile / split choices; target >= 2.5 TB/s.
- fused MoE (Triton grouped GEMM) vs the native per-expert loop at decode and
  prefill token counts, as weight bandwidth.
- routing and block alignment: Triton / torch vs the CUDA C++ kernels, to pick
  the faster one as the default.
- a device-to-device copy, the bandwidth ceiling, measured in the same run.
"""

from __future__ import annotations

import json

import torch
import triton

from deepinfer.core.backend import MoESpec, RouterSpec

ROWS: list[dict] = []


def bench(fn, reps: int = 50) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median")  # ms


def emit(**row) -> None:
    row["bench"] = "kernel"
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    tbs = 2 * x.numel() / ms / 1e9
    emit(name="d2d copy", ms=ms, TBps=tbs)
    return tbs


def mla_decode_bench(batch: int = 64, ctx: int = 4096, heads: int = 16, page: int = 64) -> None:
    from deepinfer.backends.nvidia.mla_decode import default_num_splits, mla_decode

    L, R = 512, 64
    blocks_per_seq = ctx // page
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(num_blocks, page, L + R, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, L + R, device="cuda", dtype=torch.bfloat16)
    nbytes = batch * ctx * (L + R) * 2
    # correctness at this shape against a torch reference, one sequence
    out = mla_decode(q, cache, table, seq, L, 0.1)
    kv = cache[table[0].long()].reshape(-1, L + R).float()
    ref = ((q[0].float() @ kv.T) * 0.1).softmax(-1) @ kv[:, :L]
    err = float((out[0].float() - ref).norm() / ref.norm())
    for block_n, warps, stages in ((32, 4, 2), (32, 4, 3), (64, 8, 2)):
        for splits in (None, 8, 12):
            s = splits or default_num_splits(batch, heads)
            try:
                ms = bench(lambda: mla_decode(q, cache, table, seq, L, 0.1, num_splits=s, block_n=block_n,
                                              num_warps=warps, num_stages=stages))
            except Exception as exc:  # an out-of-resources tile choice is a result, not a crash
                emit(name="mla_decode", batch=batch, ctx=ctx, block_n=block_n, warps=warps, stages=stages,
                     splits=s, error=str(exc)[:200])
                continue
            emit(name="mla_decode", batch=batch, ctx=ctx, block_n=block_n, warps=warps, stages=stages, splits=s,
                 ms=ms, TBps=nbytes / ms / 1e9, rel_err=err)


def moe_bench(tokens_list=(1, 16, 64, 256, 4096)) -> None:
    from deepinfer.backends.nvidia.fused_moe import fused_moe
    from deepinfer.backends.nvidia.moe_routing import route
    from deepinfer.core.native.moe import experts_forward

    E, D, I, K = 64, 2048, 1408, 6
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02
    spec = RouterSpec(E, K, "softmax", "greedy")
    for t in tokens_list:
        x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, E, device="cuda")
        w, ids = route(logits, spec)
        touched = int(ids.unique().numel())
        nbytes = touched * 3 * D * I * 2
        out = fused_moe(x, w13, w2, w, ids)
        ref = experts_forward(x, w13, w2, w, ids)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        ms = bench(lambda: fused_moe(x, w13, w2, w, ids))
        ms_native = bench(lambda: experts_forward(x, w13, w2, w, ids), reps=20)
        emit(name="fused_moe", tokens=t, ms=ms, TBps=nbytes / ms / 1e9, native_ms=ms_native, rel_err=err,
             tflops=2 * 3 * t * K * D * I / ms / 1e9)


def moe_tile_sweep(tokens_list=(1, 64, 256)) -> None:
    """Grouped-GEMM tile choices with the CUDA C++ alignment (what the backend runs by default)."""
    import os

    from deepinfer.backends.nvidia import cuda_ext
    from deepinfer.backends.nvidia.fused_moe import fused_moe
    from deepinfer.backends.nvidia.moe_routing import route

    align = cuda_ext.make_align(cuda_ext.load())
    E, D, I, K = 64, 2048, 1408, 6
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02
    spec = RouterSpec(E, K, "softmax", "greedy")
    tiles = ("64,64,4,3", "64,128,4,3", "128,64,4,3", "64,128,4,4", "32,128,4,4", "128,128,8,3", "64,256,4,3")
    for t in tokens_list:
        x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
        w, ids = route(torch.randn(t, E, device="cuda"), spec)
        nbytes = int(ids.unique().numel()) * 3 * D * I * 2
        for tile in tiles:
            os.environ["DEEPINFER_MOE_TILE"] = tile
            try:
                ms = bench(lambda: fused_moe(x, w13, w2, w, ids, align=align))
                emit(name="moe_tile", tokens=t, tile=tile, ms=ms, TBps=nbytes / ms / 1e9)
            except Exception as exc:
                emit(name="moe_tile", tokens=t, tile=tile, error=str(exc)[:200])
        os.environ.pop("DEEPINFER_MOE_TILE", None)


def routing_bench() -> None:
    from deepinfer.backends.nvidia import cuda_ext
    from deepinfer.backends.nvidia.moe_routing import moe_align, route

    ext = cuda_ext.load()
    for label, spec, bias in (
        ("v2-lite", RouterSpec(64, 6, "softmax", "greedy"), None),
        ("v3", RouterSpec(256, 8, "sigmoid", "noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                          routed_scaling_factor=2.5), torch.randn(256, device="cuda")),
    ):
        for t in (64, 4096):
            logits = torch.randn(t, spec.num_experts, device="cuda")
            tri = bench(lambda: route(logits, spec, bias))
            cu = bench(lambda: cuda_ext.grouped_topk(ext, logits, spec, bias))
            same = torch.equal(route(logits, spec, bias)[1], cuda_ext.grouped_topk(ext, logits, spec, bias)[1])
            emit(name="route", router=label, tokens=t, triton_ms=tri, cuda_ms=cu, same_ids=same)
    for t in (64, 4096):
        ids = torch.randint(0, 64, (t, 6), device="cuda")
        emit(name="moe_align", tokens=t, torch_ms=bench(lambda: moe_align(ids, 64, 16)),
             cuda_ms=bench(lambda: ext.moe_align(ids, 64, 16)))


def main() -> None:
    torch.manual_seed(0)
    emit(name="device", gpu=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__)
    copy_bandwidth()
    mla_decode_bench()
    moe_bench()
    try:
        moe_tile_sweep()
    except Exception as exc:
        emit(name="moe_tile", error=f"{type(exc).__name__}: {str(exc)[:2000]}")
    try:
        routing_bench()
    except Exception as exc:
        emit(name="cuda_ext", error=f"{type(exc).__name__}: {str(exc)[:2000]}")
    print("\nkernel                         ms      TB/s   note")
    for r in ROWS:
        if "ms" in r:
            note = {k: r[k] for k in ("batch", "ctx", "block_n", "warps", "stages", "splits", "tokens", "tile")
                    if k in r}
            print(f"{r['name']:<22} {r['ms']:>10.4f} {r.get('TBps', 0):>8.3f}   {note}")
        elif "triton_ms" in r or "torch_ms" in r:
            print(f"{r['name']:<22} {r}")


if __name__ == "__main__":
    main()
