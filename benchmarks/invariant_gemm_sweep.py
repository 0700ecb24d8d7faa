"""Tile sweep of the batch-invariant GEMM (backends/nvidia/invariant/gemm.py) at the V2-Lite weight shapes.

For every weight the model's invariant path multiplies by (the dense linears, the LM head, the absorbed W_UK /
W_UV batched GEMMs, the router's fp32 gate) and every candidate tile (BLOCK_M stays 64: wgmma's warpgroup
tile), it times M = 1, 64, 256 against cuBLAS (torch.matmul on the same operands) and checks that the tile is
invariant on this GPU: row 0 alone (M = 1) and rows of M = 64 equal the same rows of M = 256, bitwise. Weights
rotate over copies that exceed the L2 cache, as a decode step streams each weight once. One JSON line per
(shape, tile, M; device time from CUDA-graph replays), then per shape: the current tile, the best invariant tile by the sum of its three times, and
cuBLAS.

    python -m benchmarks.invariant_gemm_sweep [--m 1,64,256] [--json-out F]
"""

from __future__ import annotations

import argparse
import json

import torch

# name: (batch, N, K, weight dtype); the activation is bf16
SHAPES = {
    "q_proj": (1, 3072, 2048, torch.bfloat16),
    "kv_a_proj": (1, 576, 2048, torch.bfloat16),
    "o_proj": (1, 2048, 2048, torch.bfloat16),
    "shared_gate_up": (1, 5632, 2048, torch.bfloat16),
    "shared_down": (1, 2048, 2816, torch.bfloat16),
    "dense_gate_up": (1, 21888, 2048, torch.bfloat16),
    "dense_down": (1, 2048, 10944, torch.bfloat16),
    "lm_head": (1, 102400, 2048, torch.bfloat16),
    "w_uk_absorb": (16, 512, 128, torch.bfloat16),
    "w_uv": (16, 128, 512, torch.bfloat16),
    "router_fp32": (1, 64, 2048, torch.float32),
}


def candidates(fp32: bool):
    from deepinfer.backends.nvidia.invariant.gemm import BLOCK_M, Tile

    if fp32:
        return [Tile(BLOCK_M, n, k, w, s) for n in (16, 32, 64) for k in (16, 32, 64) for w in (4,) for s in (2, 3)]
    out = []
    for n in (16, 32, 64, 128, 256):
        for k in (64, 128):
            for w in ((4, 8) if n >= 64 else (4,)):
                for s in (3, 4):
                    if n == 256 and (k == 128 or w == 4):
                        continue
                    out.append(Tile(BLOCK_M, n, k, w, s))
    return out


def timed(fn, reps: int = 20) -> float:
    """Device time per call: `reps` calls captured in one CUDA graph, replayed (a Python launch costs more than
    a small GEMM, so timing eager calls would measure the host)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (3 * reps)  # us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,64,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    from deepinfer.backends.nvidia.invariant.gemm import bmm, tile_for

    ms = [int(x) for x in args.m.split(",")]
    big = max(ms)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, summary = [], []
    for name in args.shapes.split(","):
        bt, n, k, wdt = SHAPES[name]
        wbytes = bt * n * k * wdt.itemsize
        copies = max(1, min(16, (256 << 20) // wbytes))
        ws = [torch.randn(bt, n, k, device="cuda", generator=g).to(wdt) / k ** 0.5 for _ in range(copies)]
        xs = torch.randn(bt, big, k, device="cuda", generator=g).bfloat16()
        fp32 = wdt == torch.float32
        cur = tile_for(n, k, torch.float32 if fp32 else torch.bfloat16)
        res: dict = {}
        for tile in [cur] + [t for t in candidates(fp32) if t != cur]:
            try:
                full = bmm(xs, ws[0].transpose(1, 2), tile=tile)
                ok = all(torch.equal(bmm(xs[:, :m], ws[0].transpose(1, 2), tile=tile), full[:, :m]) for m in ms)
                times = {m: timed(lambda i, m=m, tile=tile: bmm(xs[:, :m], ws[i % copies].transpose(1, 2), tile=tile))
                         for m in ms}
            except Exception as exc:  # a tile this GPU / Triton cannot compile (shared memory, registers)
                print(json.dumps({"shape": name, "tile": tile.__dict__, "error": str(exc)[:200]}), flush=True)
                continue
            res[tile] = (ok, times)
            row = {"shape": name, "tile": tile.__dict__, "invariant": ok, "us": times, "current": tile == cur}
            rows.append(row)
            print(json.dumps(row), flush=True)
        cublas = {}
        for m in ms:
            if fp32:
                cublas[m] = timed(lambda i, m=m: torch.matmul(xs[:, :m].float(), ws[i % copies].transpose(1, 2)))
            else:
                cublas[m] = timed(lambda i, m=m: torch.matmul(xs[:, :m], ws[i % copies].transpose(1, 2)))
        good = {t: v for t, v in res.items() if v[0]}
        best = min(good, key=lambda t: sum(good[t][1].values())) if good else None
        summary.append((name, cur, res.get(cur), best, good.get(best), cublas))
    print(f"\n{'shape':>15} | current tile (n,k,w,s) us at M={ms} | best invariant tile us | cuBLAS us")
    for name, cur, cres, best, bres, cub in summary:
        def fmt(t, r):
            if t is None or r is None:
                return "-"
            us = "/".join(f"{r[1][m]:.1f}" for m in ms)
            return f"({t.block_n},{t.block_k},{t.num_warps},{t.num_stages}) {us}" + ("" if r[0] else " NOT INVARIANT")
        print(f"{name:>15} | {fmt(cur, cres)} | {fmt(best, bres)} | {'/'.join(f'{cub[m]:.1f}' for m in ms)}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
