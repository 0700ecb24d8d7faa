"""Batch-1 decode's small latency-bound kernels at V2-Lite shapes: tile sweeps through their env overrides.

In the int4 batch-1 decode step on an H100 (docs/perf-log/2026-12-06-session32-h100.md) the fused router
(`_gate_route_kernel`: the 64 x 2048 fp32 gate GEMV, then the top-k in the token's last program) took 8.7 us a layer
and the MLA merge + W_UV kernel (`_mla_decode_merge_uv_kernel`, 2 MB of W_UV) 11.5 us: together ~20% of the step,
the same in bf16. Both are latency-bound at one token. This times each over the tiles its env variable takes
(DEEPINFER_ROUTER_GEMV 'BLOCK_E,BLOCK_D,num_warps' for gate_route; DEEPINFER_MLA_MERGE_UV_TILE 'BLOCK_V,BLOCK_LC,
num_warps' for the MLA decode with W_UV, split kernel included), device us per call from CUDA-graph replays over
input copies the L2 cannot hold (benchmarks/graph_timing.rotating_graph_us), and checks each tile's result against
the default tile's (the router's expert ids equal; the MLA output within bf16 rounding). Prints JSON lines, then
the best tile of each as `ENV=value` lines (`best:` prefix) for an A/B of the whole step. GPU only. The defaults
since session 32 (router 1,512,1 at one token; merge + W_UV 32,128,4) are the first sweep's winners.

    python -m benchmarks.b1_small_kernels [--json out.jsonl] [--context 1033]
"""

from __future__ import annotations

import argparse
import json
import os

E, D, TOP_K = 64, 2048, 6  # V2-Lite's router
H, L, R, V, PAGE = 16, 512, 64, 128, 64  # V2-Lite's MLA (latent, rope, value head dims) and the KV page

# the first tile of each list is the default (the reference the others' results are checked against)
ROUTER_TILES = ["1,512,1", "2,1024,4", "1,256,1", "1,128,1", "1,2048,1", "1,1024,1", "2,512,1", "1,512,2",
                "2,1024,1", "4,512,1"]
MERGE_UV_TILES = ["32,128,4", "32,64,4", "32,256,4", "16,256,4", "32,512,8", "16,512,4", "32,256,8", "64,128,4",
                  "16,128,2", "8,256,2", "32,128,8", "128,128,8", "64,256,8"]


def _sweep(env: str, tiles: list[str], fn, copies: int, same) -> list[dict]:
    """Each tile's us per call (fn(i) under env=tile) and whether its result matches the first tile's."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from benchmarks.graph_timing import rotating_graph_us

    rows, ref = [], None
    for tile in tiles:
        os.environ[env] = tile
        try:
            out = fn(0)
            ref = out if ref is None else ref
            us = rotating_graph_us(fn, copies, reps=min(40, 4 * copies))
            rows.append({"env": env, "tile": tile, "us": round(us, 2), "same": bool(same(out, ref))})
        except (CompilationError, OutOfResources, RuntimeError) as e:  # a tile the compiler or device refuses
            rows.append({"env": env, "tile": tile, "error": f"{type(e).__name__}: {e}"[:200]})
        print(json.dumps(rows[-1]), flush=True)
    os.environ.pop(env, None)
    return rows


def router_rows() -> list[dict]:
    import torch

    from deepinfer.backend import RouterSpec
    from deepinfer.backends.nvidia.moe_routing import gate_route

    spec = RouterSpec(E, TOP_K, "softmax", "greedy")
    copies = (512 << 20) // (E * D * 4)
    gates = [torch.randn(E, D, device="cuda") / 40 for _ in range(copies)]
    x = torch.randn(1, D, device="cuda").bfloat16()
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")
    return _sweep("DEEPINFER_ROUTER_GEMV", ROUTER_TILES, lambda i: gate_route(x, gates[i], spec, None, counters),
                  copies, lambda a, b: torch.equal(a[1], b[1]) and torch.allclose(a[0], b[0], rtol=1e-5, atol=0))


def merge_uv_rows(context: int) -> list[dict]:
    import torch

    from deepinfer.backends.nvidia.mla_decode import mla_decode

    per = -(-(context + 1) // PAGE)
    set_bytes = per * PAGE * (L + R) * 2 + H * L * V * 2
    copies = max(2, (768 << 20) // set_bytes)
    sets = []
    for _ in range(copies):
        cache = torch.randn(per, PAGE, L + R, device="cuda").bfloat16()
        w_uv_t = (torch.randn(H, L, V, device="cuda") / 16).bfloat16()
        sets.append((cache, w_uv_t))
    table = torch.arange(per, device="cuda", dtype=torch.int32).view(1, per)
    seq = torch.tensor([context], device="cuda", dtype=torch.int32)
    q = torch.randn(1, H, L + R, device="cuda").bfloat16()

    def fn(i):
        cache, w = sets[i % copies]
        return mla_decode(q, cache, table, seq, L, 0.1, w_uv_t=w)

    return _sweep("DEEPINFER_MLA_MERGE_UV_TILE", MERGE_UV_TILES, fn, copies,
                  lambda a, b: (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item())


def best(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if "us" in r and r["same"]]
    return min(ok, key=lambda r: r["us"]) if ok else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--context", type=int, default=1033, help="the MLA decode's context (tokens in the cache)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.b1_small_kernels needs a CUDA GPU")
    rows = router_rows() + merge_uv_rows(args.context)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    for env in ("DEEPINFER_ROUTER_GEMV", "DEEPINFER_MLA_MERGE_UV_TILE"):
        mine = [r for r in rows if r["env"] == env]
        b, default = best(mine), mine[0]
        print(f"{env}: default {default['tile']} {default.get('us')} us; best {b and b['tile']} {b and b['us']} us")
        if b is not None:
            print(f"best: {env}={b['tile']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
