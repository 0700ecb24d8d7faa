"""Plan sweep of the batch-invariant GEMM (backends/nvidia/invariant/gemm.py) and grouped GEMM at V2-Lite shapes.

A plan is a tile and a K split (gemm.Plan), both fixed per weight. For every weight the model's invariant path
multiplies by (the dense linears, the LM head, the absorbed W_UK / W_UV batched GEMMs, the router's split
gate) and every candidate plan, it times M = 1, 64, 256 (decode) and 8192 (a prefill step) against cuBLAS
(torch.matmul on the same operands), with the schedule the op picks for that M (gemm.parallel_pays), and checks
on this GPU that the plan is invariant: rows of M = 1 / 64 / 256 equal the same rows of the largest M, bitwise,
and the serial and parallel schedules agree. Weights rotate over copies that exceed the L2 cache, as a decode
step streams each weight once. One JSON line per (shape, plan, M; device time from CUDA-graph replays), then
per shape: the current plan, the best invariant plan by the sum over M of time / cuBLAS time (each M weighs
the same), and cuBLAS.

Two more sections (information for the next tuning round, not used by the op):
- `cross_plan_equal`: whether plans with different tiles give the same bits for the same weight (if the MMA's
  per-element result did not depend on the tile's N, a tile could follow M; the op never assumes it);
- `--moe`: the invariant MoE's routed + shared experts (InvariantMoE._experts) at T = 1, 64, 256, 8192 with the
  grouped GEMM's K split at 1 and 2 slices.

    python -m benchmarks.invariant_gemm_sweep [--m 1,64,256,8192] [--shapes q_kv_a_proj,o_proj] [--moe] [--json-out F]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.graph_timing import rotating_graph_us

# name: (batch, N, K, weight dtype); the activation is bf16
SHAPES = {
    "q_kv_a_proj": (1, 3648, 2048, torch.bfloat16),  # V2-Lite's q_proj and kv_a_proj_with_mqa, merged
    "kv_a_proj": (1, 576, 2048, torch.bfloat16),  # V2 / V3 (q_lora_rank) merge q_a with it instead
    "o_proj": (1, 2048, 2048, torch.bfloat16),
    "dense_gate_up": (1, 21888, 2048, torch.bfloat16),
    "dense_down": (1, 2048, 10944, torch.bfloat16),
    "lm_head": (1, 102400, 2048, torch.bfloat16),
    "w_uk_absorb": (16, 512, 128, torch.bfloat16),
    "w_uv": (16, 128, 512, torch.bfloat16),
    "router_split": (1, 192, 2048, torch.bfloat16),  # the fp32 gate as three bf16 parts (router.split_gate)
}


# the LM head (S = 1, the 128-column tile swept on 2026-12-01) and the dense layer's gate_up (one layer) only on
# request: a prefill M of their sizes costs seconds per plan
DEFAULT_SHAPES = [s for s in SHAPES if s not in ("lm_head", "dense_gate_up")]
# what a V2-Lite decode step runs in every layer, and the LM head (kv_a_proj and the dense layer's MLP are not)
HOT_SHAPES = ["q_kv_a_proj", "o_proj", "w_uk_absorb", "w_uv", "router_split", "lm_head"]


def candidates(n: int, k: int):
    from deepinfer.backends.nvidia.invariant.gemm import BLOCK_M, Plan, Tile

    # 64 x 64 / 64 x 128 tiles at BLOCK_K 64 (prefill's MMA shape) and deeper K steps (more weight bytes in flight
    # per program: what a decode GEMV at M = 1 is bound by), shared memory <= ~160 KB at every depth
    tiles = [Tile(BLOCK_M, 64, 64, 4, 4), Tile(BLOCK_M, 128, 64, 4, 3), Tile(BLOCK_M, 32, 128, 4, 4),
             Tile(BLOCK_M, 64, 128, 4, 3), Tile(BLOCK_M, 128, 128, 8, 3), Tile(BLOCK_M, 32, 256, 4, 3)]
    if n >= 16384:
        tiles.append(Tile(BLOCK_M, 128, 64, 8, 4))
    out = []
    for t in tiles:
        for s in (1, 2, 4, 8):
            sk = -(-k // s)
            sk = -(-sk // t.block_k) * t.block_k
            if s > 1 and (sk < t.block_k * 2 or -(-k // sk) != s):
                continue
            if s > 1 and -(-n // t.block_n) * s > 4 * 132:  # past four waves of programs at M <= 64: no gain
                continue
            out.append(Plan(t, sk))
    return out


def timed(fn, reps: int = 20) -> float:
    """Device µs per call fn(i), i = 0 .. reps - 1 (the callers pick their weight copy from i), from CUDA-graph
    replays (benchmarks/graph_timing.py)."""
    return rotating_graph_us(fn, copies=reps, reps=reps, warm=3)


def _label(p) -> str:
    t = p.tile
    return f"n{t.block_n} k{t.block_k} w{t.num_warps} s{t.num_stages} slice{p.slice_k}"


def sweep_shape(name: str, ms: list[int], g: torch.Generator) -> tuple:
    from deepinfer.backends.nvidia.invariant.gemm import bmm, plan_for

    bt, n, k, wdt = SHAPES[name]
    big = max(ms)
    wbytes = bt * n * k * wdt.itemsize
    copies = max(1, min(16, (256 << 20) // wbytes))
    ws = [torch.randn(bt, n, k, device="cuda", generator=g).to(wdt) / k ** 0.5 for _ in range(copies)]
    xs = torch.randn(bt, big, k, device="cuda", generator=g).bfloat16()
    cur = plan_for(bt, n, k, torch.bfloat16)
    res, rows, bits = {}, [], {}
    # cuBLAS first, so a sweep cut short by its time limit still has each finished shape's baseline
    cublas = {m: timed(lambda i, m=m: torch.matmul(xs[:, :m], ws[i % copies].transpose(1, 2)),
                       reps=4 if m >= 4096 else 20) for m in ms}
    print(json.dumps({"shape": name, "cublas_us": cublas}), flush=True)
    for plan in [cur] + [p for p in candidates(n, k) if p != cur]:
        try:
            full = bmm(xs, ws[0].transpose(1, 2), plan=plan)
            ok = all(torch.equal(bmm(xs[:, :m], ws[0].transpose(1, 2), plan=plan), full[:, :m]) for m in ms)
            for m in ms[:2]:  # both schedules, same bits
                a = xs[:, :m]
                ok = ok and torch.equal(bmm(a, ws[0].transpose(1, 2), plan=plan, parallel=True),
                                        bmm(a, ws[0].transpose(1, 2), plan=plan, parallel=False))
            bits[plan] = full[:, :64].clone()
            times = {m: timed(lambda i, m=m, plan=plan: bmm(xs[:, :m], ws[i % copies].transpose(1, 2), plan=plan),
                              reps=4 if m >= 4096 else 20) for m in ms}
        except Exception as exc:  # a plan this GPU / Triton cannot compile (shared memory, registers)
            print(json.dumps({"shape": name, "plan": _label(plan), "error": str(exc)[:200]}), flush=True)
            continue
        res[plan] = (ok, times)
        row = {"shape": name, "plan": _label(plan), "invariant": ok, "us": times, "current": plan == cur}
        rows.append(row)
        print(json.dumps(row), flush=True)
    # do plans with other tiles but the same K split give the same bits? (information; see the docstring)
    groups: dict = {}
    for p, v in bits.items():
        groups.setdefault((p.slice_k, p.tile.block_k), []).append(v)
    same = [all(torch.equal(v[0], w) for w in v[1:]) for v in groups.values() if len(v) > 1]
    print(json.dumps({"shape": name, "cross_plan_equal": same}), flush=True)
    good = {p: v for p, v in res.items() if v[0]}
    score = {p: sum(v[1][m] / cublas[m] for m in ms) for p, v in good.items()}
    best = min(score, key=score.get) if score else None
    return rows, (name, cur, res.get(cur), best, good.get(best), cublas)


def sweep_moe(ts: list[int], g: torch.Generator) -> list[dict]:
    """InvariantMoE._experts at V2-Lite's MoE (64 experts, top-6, 2 shared, hidden 2048, intermediate 1408)."""
    from deepinfer.backend import MoESpec, RouterSpec
    from deepinfer.backends.nvidia.invariant import moe_gemm
    from deepinfer.backends.nvidia.invariant.moe import InvariantMoE

    router = RouterSpec(num_experts=64, top_k=6, topk_method="greedy", scoring_func="softmax", n_group=1,
                        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    op = InvariantMoE(MoESpec(router=router, hidden_size=2048, intermediate_size=1408))
    op.load_experts(torch.randn(64, 2816, 2048, device="cuda", generator=g).bfloat16() * 0.02,
                    torch.randn(64, 2048, 1408, device="cuda", generator=g).bfloat16() * 0.02)
    op.fuse_shared_experts(torch.randn(5632, 2048, device="cuda", generator=g).bfloat16() * 0.02,
                           torch.randn(2048, 2816, device="cuda", generator=g).bfloat16() * 0.02)
    rows = []
    cur = {"dual": moe_gemm.tile(True), "down": moe_gemm.tile(False)}
    tiles = [cur] + [{"dual": dict(BLOCK_N=dn, BLOCK_K=bk, num_warps=w, num_stages=st),
                      "down": dict(BLOCK_N=2 * dn, BLOCK_K=bk, num_warps=w, num_stages=st)}
                     for dn, bk, w, st in ((64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (32, 128, 4, 4),
                                           (64, 128, 8, 3))]
    inputs = {}
    for t in ts:  # drawn once, shared by every tile
        ids = torch.rand(t, 64, device="cuda", generator=g).argsort(dim=1)[:, :6]
        inputs[t] = (torch.randn(t, 2048, device="cuda", generator=g).bfloat16(), ids,
                     torch.rand(t, 6, device="cuda", generator=g))
    # BLOCK_M = 128 pairs per expert tile (prefill's MMA shape; the op keeps 64): 8 warps
    big = [{"dual": dict(BLOCK_N=bn, BLOCK_K=64, num_warps=8, num_stages=st),
            "down": dict(BLOCK_N=2 * bn, BLOCK_K=64, num_warps=8, num_stages=st)} for bn, st in ((64, 3), (32, 4))]
    plans = ([(t, moe_gemm.MOE_SLICE_K, None) for t in tiles] + [(cur, 1024, None)]
             + [(t, moe_gemm.MOE_SLICE_K, 128) for t in big])
    for ti, (tl_, slice_k, bm) in enumerate(plans):
        # any fixed tile, slice and BLOCK_M is invariant; the op keeps moe_gemm's and moe.BLOCK_M
        op.slice_k, op.tile, op.block_m_override = slice_k, tl_, bm
        try:
            x, ids, w = inputs[max(ts)]
            full = op._experts(x, w, ids, lambda _: None, False)
            ok = all(torch.equal(op._experts(x[:m], w[:m], ids[:m], lambda _: None, False), full[:m]) for m in ts)
        except Exception as exc:  # a tile this GPU / Triton cannot compile
            print(json.dumps({"moe": "routed+shared", "tile": tl_, "error": str(exc)[:200]}), flush=True)
            continue
        for t in ts:
            x, ids, w = inputs[t]
            us = timed(lambda i, x=x, ids=ids, w=w: op._experts(x, w, ids, lambda _: None, False),
                       reps=4 if t >= 4096 else 20)
            row = {"moe": "routed+shared", "T": t, "slice_k": slice_k, "tile": tl_, "block_m": bm or 64,
                   "current": ti == 0, "invariant": ok, "us": us}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,64,256,8192")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="comma list, or 'hot' (HOT_SHAPES)")
    ap.add_argument("--moe", action="store_true", help="also time the invariant MoE at 1 and 2 K slices")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    ms = [int(x) for x in args.m.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, summary = [], []
    names = HOT_SHAPES if args.shapes == "hot" else [s for s in args.shapes.split(",") if s]
    for name in names:
        r, s = sweep_shape(name, ms, g)
        rows += r
        summary.append(s)
    if args.moe:
        rows += sweep_moe(ms, g)
    print(f"\n{'shape':>15} | current plan: us at M={ms} | best invariant plan (sum of time / cuBLAS) | cuBLAS us")
    for name, cur, cres, best, bres, cub in summary:
        def fmt(p, r):
            if p is None or r is None:
                return "-"
            us = "/".join(f"{r[1][m]:.1f}" for m in ms)
            return f"({_label(p)}) {us}" + ("" if r[0] else " NOT INVARIANT")
        print(f"{name:>15} | {fmt(cur, cres)} | {fmt(best, bres)} | {'/'.join(f'{cub[m]:.1f}' for m in ms)}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
