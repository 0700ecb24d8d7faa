"""Batch-1 decode's small latency-bound kernels at V2-Lite shapes: tile sweeps through their env overrides.

In the int4 batch-1 decode step on an H100 (docs/perf-log/2026-12-06-session32-h100.md) the fused router
(`_gate_route_kernel`: the 64 x 2048 fp32 gate GEMV, then the top-k in the token's last program) took 8.7 us a layer
and the MLA merge + W_UV kernel (`_mla_decode_merge_uv_kernel`, 2 MB of W_UV) 11.5 us: together ~20% of the step,
the same in bf16. Both are latency-bound at one token. This times each over the tiles its env variable takes
(DEEPINFER_ROUTER_GEMV 'BLOCK_E,BLOCK_D,num_warps' for gate_route; DEEPINFER_MLA_MERGE_UV_TILE 'BLOCK_V,BLOCK_LC,
num_warps' for the MLA decode with W_UV, split kernel included), device us per call from CUDA-graph replays over
input copies the L2 cannot hold (benchmarks/graph_timing.rotating_graph_us), and checks each tile's result against
the default tile's (the router's expert ids equal; the MLA output within bf16 rounding). Prints JSON lines, then
the best tile of each as `ENV=value` lines (`best:` prefix) for an A/B of the whole step. Then the MLA decode's launch
at batch 1 (splits, tile, minimum split, warps, stages: decode_params' pick and others, passed to mla_decode), and
the router tiles at more tokens (reported). GPU only. The defaults since session 32 are these sweeps' winners on an
H100: the router's 1,512,1 up to 16 tokens, the merge + W_UV's 32,512,8 at 32 launched splits (a rule by splits).

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
MERGE_UV_TILES = ["32,512,8", "32,128,4", "32,64,4", "32,256,4", "16,256,4", "16,512,4", "32,256,8", "64,128,4",
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


def router_rows(tokens: int = 1) -> list[dict]:
    """gate_route over ROUTER_TILES at `tokens` tokens (env 'DEEPINFER_ROUTER_GEMV' at one token, with '@T' after
    it at more: those rows are reported, not A/B'd)."""
    import torch

    from deepinfer.backend import RouterSpec
    from deepinfer.backends.nvidia.moe_routing import gate_route

    spec = RouterSpec(E, TOP_K, "softmax", "greedy")
    copies = (512 << 20) // (E * D * 4)
    gates = [torch.randn(E, D, device="cuda") / 40 for _ in range(copies)]
    x = torch.randn(tokens, D, device="cuda").bfloat16()
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")
    rows = _sweep("DEEPINFER_ROUTER_GEMV", ROUTER_TILES, lambda i: gate_route(x, gates[i], spec, None, counters),
                  copies, lambda a, b: torch.equal(a[1], b[1]) and torch.allclose(a[0], b[0], rtol=1e-5, atol=0))
    if tokens > 1:
        for r in rows:
            r["env"] = f"DEEPINFER_ROUTER_GEMV@{tokens}"
    return rows


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


# the MLA decode's launch at batch 1 (num_splits, block_n, min_split, num_warps, num_stages); None: decode_params'
# pick for the block table's width (in the engine that is max_model_len's)
MLA_LAUNCHES = [None, (16, 64, 128, 8, 2), (8, 64, 192, 8, 2), (32, 32, 32, 4, 3), (19, 64, 64, 4, 3),
                (10, 64, 128, 4, 3), (16, 64, 128, 4, 2), (12, 64, 128, 8, 3), (24, 32, 64, 4, 3), (64, 64, 64, 8, 2)]


def mla_launch_rows(context: int, table_tokens: int) -> list[dict]:
    """The MLA decode (split kernel + merge + W_UV, the default merge tile) at batch 1 over MLA_LAUNCHES, us a call,
    each launch's output checked against decode_params' (within 1% of its max)."""
    import torch

    from benchmarks.graph_timing import rotating_graph_us
    from deepinfer.backends.nvidia.mla_decode import decode_params, mla_decode

    per = -(-(context + 1) // PAGE)
    width = max(per, -(-table_tokens // PAGE))
    copies = max(2, (768 << 20) // (per * PAGE * (L + R) * 2 + H * L * V * 2))
    sets = [(torch.randn(per, PAGE, L + R, device="cuda").bfloat16(),
             (torch.randn(H, L, V, device="cuda") / 16).bfloat16()) for _ in range(copies)]
    table = torch.zeros(1, width, device="cuda", dtype=torch.int32)
    table[0, :per] = torch.arange(per, device="cuda", dtype=torch.int32)
    seq = torch.tensor([context], device="cuda", dtype=torch.int32)
    q = torch.randn(1, H, L + R, device="cuda").bfloat16()
    auto = decode_params(1, H, width * PAGE)
    rows, ref = [], None
    for launch in MLA_LAUNCHES:
        splits, block_n, min_split, warps, stages = launch or (auto.num_splits, auto.block_n, auto.min_split,
                                                               auto.num_warps, auto.num_stages)

        def fn(i, a=(splits, block_n, min_split, warps, stages)):
            cache, w = sets[i % copies]
            return mla_decode(q, cache, table, seq, L, 0.1, num_splits=a[0], block_n=a[1], min_split=a[2],
                              num_warps=a[3], num_stages=a[4], w_uv_t=w)

        tile = f"{splits},{block_n},{min_split},{warps},{stages}" + (" (decode_params)" if launch is None else "")
        out = fn(0)
        ref = out if ref is None else ref
        same = (out.float() - ref.float()).abs().max().item() <= 1e-2 * ref.float().abs().max().item()
        us = rotating_graph_us(fn, copies, reps=min(40, 4 * copies))
        rows.append({"env": "mla_launch", "tile": tile, "us": round(us, 2), "same": bool(same)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def best(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if "us" in r and r["same"]]
    return min(ok, key=lambda r: r["us"]) if ok else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--context", type=int, default=1033, help="the MLA decode's context (tokens in the cache)")
    ap.add_argument("--router-tokens", type=lambda v: [int(t) for t in v.split(",") if t], default=[4, 16],
                    help="more token counts to time the router tiles at (reported only; '' for none)")
    ap.add_argument("--table-tokens", type=int, default=1168,
                    help="the block table's width in tokens for the launch sweep (the engine's max_model_len: "
                         "benchmarks.throughput's prompt 1024 + 128 + 16)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.b1_small_kernels needs a CUDA GPU")
    rows = router_rows() + merge_uv_rows(args.context) + mla_launch_rows(args.context, args.table_tokens)
    for t in args.router_tokens:
        rows += router_rows(t)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    for env in dict.fromkeys(r["env"] for r in rows):
        mine = [r for r in rows if r["env"] == env]
        b, default = best(mine), mine[0]
        print(f"{env}: default {default['tile']} {default.get('us')} us; best {b and b['tile']} {b and b['us']} us")
        if b is not None and env.startswith("DEEPINFER_") and "@" not in env:
            print(f"best: {env}={b['tile']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
