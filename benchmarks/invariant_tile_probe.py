"""Do a row's bits depend on the MMA tile? A GPU probe for issue 14's invariant kernels (information + timing).

The invariant GEMM keeps one tile for every M (gemm.py). Whether that is needed depends on the hardware: a
Hopper tensor-core MMA adds one 16-deep K step at a time into the fp32 accumulator, and Triton issues the steps
in K order, so the tile's rows and columns (BLOCK_M, BLOCK_N), its depth (BLOCK_K) and its warps may not enter a
row's arithmetic at all. If they do not, the tile may follow M (large tiles for prefill) while the K split stays
a property of the weight. This probe measures it, it does not assume it:

- GEMM: for each V2-Lite weight, the op's plan and tiles of other BLOCK_M (16, 64, 128), BLOCK_N, BLOCK_K, warps
  and stages with the same K split, at M = 1, 7, 129 and 8192: bitwise equal to the op's plan or not, and the
  device µs at M = 1 and 8192 (cuBLAS alongside);
- MoE: the grouped GEMMs with BLOCK_M 16 to 128 and other tiles at T = 1, 8, 8192;
- MLA: the invariant attention over a 16 x 512-token prefill with BLOCK_Q = 1, 2, 4, 8 query tokens per program
  (16-row to 128-row MMA tiles) and 4 to 16 warps, with the softmax's row sums by tl.sum or by an MMA: bitwise
  equal to BLOCK_Q = 1 with 4 warps (what decode runs) or not, and its ms; and decode's cost of each row sum.

  python -m benchmarks.invariant_tile_probe [--json-out F]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.graph_timing import graph_ms, rotating_graph_us

SHAPES = {  # [batch of weights, N, K] of V2-Lite (bf16)
    "q_kv_a_proj": (1, 3648, 2048),
    "o_proj": (1, 2048, 2048),
    "w_uk_absorb": (16, 512, 128),
    "w_uv": (16, 128, 512),
    "router_split": (1, 192, 2048),
    "dense_gate_up": (1, 21888, 2048),
    "dense_down": (1, 2048, 10944),
    "shared_gate_up": (1, 5632, 2048),
    "shared_down": (1, 2048, 2816),
}
MS = (1, 7, 129, 8192)


def _emit(out, row: dict) -> None:
    print(json.dumps(row), flush=True)
    if out:
        out.write(json.dumps(row) + "\n")


def gemm_tiles(block_k_ok) -> list:
    from deepinfer.backends.nvidia.invariant.gemm import Tile

    tiles = [Tile(16, 64, 128, 4, 4), Tile(16, 128, 64, 4, 4), Tile(64, 64, 64, 4, 4), Tile(64, 64, 128, 4, 3),
             Tile(64, 128, 64, 4, 3), Tile(64, 128, 64, 8, 4), Tile(64, 256, 64, 8, 3), Tile(128, 128, 64, 8, 3),
             Tile(128, 128, 64, 4, 3), Tile(128, 256, 64, 8, 3), Tile(128, 128, 128, 8, 2)]
    return [t for t in tiles if block_k_ok(t.block_k)]


def probe_gemm(out) -> None:
    from deepinfer.backends.nvidia.invariant.gemm import Plan, bmm, plan_for

    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (bt, n, k) in SHAPES.items():
        base = plan_for(bt, n, k, torch.bfloat16)
        w = (torch.randn(bt, n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        x = torch.randn(bt, max(MS), k, device="cuda", generator=g).bfloat16()
        ref = bmm(x, w.transpose(1, 2), plan=base)
        cub = {m: rotating_graph_us(lambda i, m=m: torch.matmul(x[:, :m], w.transpose(1, 2)), copies=1,
                                    reps=4 if m > 1024 else 20) for m in (1, 8192)}
        _emit(out, {"gemm": name, "plan": str(base), "cublas_us": cub})
        for t in gemm_tiles(lambda bk: base.slice_k % bk == 0):
            plan = Plan(t, base.slice_k)
            label = f"m{t.block_m} n{t.block_n} k{t.block_k} w{t.num_warps} s{t.num_stages}"
            try:
                same = {m: torch.equal(bmm(x[:, :m], w.transpose(1, 2), plan=plan), ref[:, :m]) for m in MS}
                us = {m: rotating_graph_us(lambda i, m=m: bmm(x[:, :m], w.transpose(1, 2), plan=plan), copies=1,
                                           reps=4 if m > 1024 else 20) for m in (1, 8192)}
            except Exception as exc:  # a tile this GPU cannot compile (shared memory)
                _emit(out, {"gemm": name, "tile": label, "error": str(exc)[:160]})
                continue
            _emit(out, {"gemm": name, "tile": label, "same_bits": same, "us": us,
                        "is_plan": t == base.tile})


def _compiled(jit_fn) -> dict:
    """{cache key: (registers, spills)} of a Triton kernel's compiled variants (Triton 3.x internals; {} if they move;
    None for a variant that does not fit the device)."""
    from triton.runtime.errors import OutOfResources

    found = {}
    try:
        for cache in jit_fn.device_caches.values():
            for key, k in cache[0].items():
                try:
                    k._init_handles()
                    found[key] = (k.n_regs, k.n_spills)
                except OutOfResources:
                    found[key] = None
    except (AttributeError, TypeError, IndexError):
        return {}
    return found


MLA_PREFILL_SHAPE = (16, 512, 64, 64, 16, 512)  # heads, kv_lora, rope, page, prompts, prompt length (V2-Lite)


def _mla_prefill_inputs():
    """(generator, cache, table, seq_lens, q_lat, q_pe) of a random 16 x 512-token prefill at V2-Lite's MLA shape."""
    H, L, R, page, reqs, n = MLA_PREFILL_SHAPE
    g = torch.Generator(device="cuda").manual_seed(1)
    per = n // page
    cache = torch.randn(reqs * per, page, L + R, device="cuda", generator=g).bfloat16()
    table = torch.arange(reqs * per, device="cuda", dtype=torch.int32).view(reqs, per)
    seq = torch.full((reqs,), n, device="cuda", dtype=torch.int32)
    q = torch.randn(reqs * n, H, L, device="cuda", generator=g).bfloat16() * 0.05
    qpe = torch.randn(reqs * n, H, R, device="cuda", generator=g).bfloat16() * 0.05
    return g, cache, table, seq, q, qpe


def probe_mla(out, only_mla: list | None = None) -> None:
    from deepinfer.backends.nvidia.invariant.mla import mla_attention, qblocks_host
    from deepinfer.backends.nvidia.invariant.mla_kernels import _mla_onestage_kernel

    _, L, R, page, reqs, n = MLA_PREFILL_SHAPE
    g, cache, table, seq, q, qpe = _mla_prefill_inputs()
    scale = 192 ** -0.5
    variants = [(False, 1, 4), (False, 2, 4), (False, 4, 4), (False, 8, 4), (False, 2, 8),
                (True, 1, 4), (True, 1, 8), (True, 2, 4), (True, 2, 8), (True, 4, 4), (True, 4, 8), (True, 4, 16),
                (True, 8, 8)]
    if only_mla is not None:
        variants = [(True, 1, 4)] + only_mla
    base = {}  # row-sum method -> its block_q 1, 4-warp output (what decode runs)
    for rowsum, bq, warps in variants:
        qb = qblocks_host([n] * reqs, [0] * reqs, torch.device("cuda"), bq)
        kw = {"two_stage": False, "block_q": bq, "num_warps": warps, "rowsum_mma": rowsum}
        name = f"rowsum {'mma' if rowsum else 'tl.sum'} block_q {bq} warps {warps}"
        seen = _compiled(_mla_onestage_kernel)
        try:
            o = mla_attention(q, qpe, cache, table, seq, qb, scale, **kw)
            ms = graph_ms(lambda: mla_attention(q, qpe, cache, table, seq, qb, scale, **kw), reps=10)
        except Exception as exc:  # e.g. out of shared memory at a large tile
            _emit(out, {"mla": name, "error": str(exc)[:160]})
            continue
        ref = base.setdefault(rowsum, o)
        diff = (o.float() - ref.float()).abs()
        _emit(out, {"mla": name, "same_bits": bool(torch.equal(o, ref)),
                    "rows_differing": int((diff.amax(-1) > 0).sum()), "max_abs_diff": float(diff.max()), "ms": ms,
                    "regs_spills": [v for k, v in _compiled(_mla_onestage_kernel).items() if k not in seen]})
    if only_mla is not None:
        return
    if len(base) == 2:
        d = (base[True].float() - base[False].float()).abs()
        _emit(out, {"mla": "rowsum mma vs tl.sum (block_q 1)", "max_abs_diff": float(d.max()),
                    "rows_differing": int((d.amax(-1) > 0).sum())})
    last = torch.arange(reqs, device="cuda") * n + n - 1
    for rowsum in base:
        dec = mla_attention(q[last].contiguous(), qpe[last].contiguous(), cache, table, seq, None, scale,
                            rowsum_mma=rowsum)
        _emit(out, {"mla": f"decode rows == prefill rows (rowsum {'mma' if rowsum else 'tl.sum'})",
                    "same_bits": bool(torch.equal(dec, base[rowsum][last]))})
    # decode cost of each row-sum method (and 8 warps): batch 1 and 64 at 4096 entries of context (the decode schedule)
    ctx, per = 4096, 4096 // page
    for b in (1, 64):
        dcache = torch.randn(b * per, page, L + R, device="cuda", generator=g).bfloat16()
        dtable = torch.arange(b * per, device="cuda", dtype=torch.int32).view(b, per)
        dseq = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        dq, dpe = q[:b].contiguous(), qpe[:b].contiguous()
        us = {f"{'mma' if r else 'tl.sum'} w{w}": round(1000 * graph_ms(
            lambda r=r, w=w: mla_attention(dq, dpe, dcache, dtable, dseq, None, scale, rowsum_mma=r, num_warps=w),
            reps=20), 1) for r, w in ((False, 4), (True, 4), (True, 8))}
        _emit(out, {"mla": f"decode batch {b} context {ctx} (us)", "us": us})


def probe_moe(out) -> None:
    """V2-Lite's MoE layer (64 experts top-6, 2 shared experts folded in): BLOCK_M 16 / 32 / 64 / 128 and other
    tiles against the op's (BLOCK_M 64), at T = 1, 8, 8192: same bits? device µs?"""
    from deepinfer.backend import MoESpec, RouterSpec
    from deepinfer.backends.nvidia.invariant.moe import InvariantMoE

    router = RouterSpec(num_experts=64, top_k=6, topk_method="greedy", scoring_func="softmax", n_group=1,
                        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    spec = MoESpec(router=router, hidden_size=2048, intermediate_size=1408)
    g = torch.Generator(device="cuda").manual_seed(2)

    def rnd(*shape, scale=0.02, dtype=torch.bfloat16):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    w13, w2 = rnd(64, 2816, 2048), rnd(64, 2048, 1408)
    gate_up, down, gate = rnd(5632, 2048), rnd(2048, 2816), rnd(64, 2048, dtype=torch.float32)
    x = rnd(8192, 2048, scale=1.0)
    op = InvariantMoE(spec)
    op.load_experts(w13, w2)
    assert op.fuse_shared_experts(gate_up, down)
    shared = lambda t: t  # noqa: E731  (folded: never called)
    run = lambda t: op.forward_hidden(x[:t], gate, None, shared_experts=shared)  # noqa: E731
    ref = {t: run(t) for t in (1, 8, 8192)}
    variants = [(16, None), (32, None), (128, None),
                (16, {"dual": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
                      "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}}),
                (64, {"dual": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
                      "down": {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}}),
                (128, {"dual": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
                       "down": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}}),
                (64, None)]
    for bm, tile in variants:
        op.block_m_override, op.tile = bm, tile
        try:
            same = {t: torch.equal(run(t), ref[t]) for t in ref}
            us = {t: rotating_graph_us(lambda i, t=t: run(t), copies=1, reps=4 if t > 1024 else 20) for t in (1, 8192)}
        except Exception as exc:
            _emit(out, {"moe": f"block_m {bm} tile {tile}", "error": str(exc)[:160]})
            continue
        _emit(out, {"moe": f"block_m {bm} tile {tile}", "same_bits": same, "us": us})
    op.block_m_override = op.tile = None


def probe_thresholds(out) -> None:
    """Where the faster tiles start to pay: tile_choice's large GEMM tiles against the plans' at M = 256 .. 2048, the
    MoE's BLOCK_M 16 (small tile) and 128 against 64 at the token counts around MOE_SMALL_PAIRS / MOE_LARGE_T."""
    from deepinfer.backend import MoESpec, RouterSpec
    from deepinfer.backends.nvidia.invariant.gemm import bmm, plan_for
    from deepinfer.backends.nvidia.invariant.moe import InvariantMoE
    from deepinfer.backends.nvidia.invariant.tile_choice import LARGE_TILES_BF16, MOE_LARGE, MOE_SMALL

    g = torch.Generator(device="cuda").manual_seed(3)
    for (bt, n, k), tile in LARGE_TILES_BF16.items():
        w = (torch.randn(bt, n, k, device="cuda", generator=g) / k ** 0.5).bfloat16().transpose(1, 2)
        x = torch.randn(bt, 2048, k, device="cuda", generator=g).bfloat16()
        plan = plan_for(bt, n, k, torch.bfloat16)
        row = {}
        for m in (256, 512, 1024, 2048):
            row[m] = [round(rotating_graph_us(lambda i, m=m, t=t: bmm(x[:, :m], w, plan=plan, tile=t), copies=1,
                                              reps=8), 1) for t in (None, tile)]
        _emit(out, {"threshold": f"gemm [{bt}, {n}, {k}]", "us_plan_vs_large": row})
    router = RouterSpec(num_experts=64, top_k=6, topk_method="greedy", scoring_func="softmax", n_group=1,
                        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    op = InvariantMoE(MoESpec(router=router, hidden_size=2048, intermediate_size=1408))
    op.load_experts((torch.randn(64, 2816, 2048, device="cuda", generator=g) * 0.02).bfloat16(),
                    (torch.randn(64, 2048, 1408, device="cuda", generator=g) * 0.02).bfloat16())
    x = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
    ids = torch.rand(4096, 64, device="cuda", generator=g).topk(6, dim=1).indices.to(torch.int32)
    wts = torch.rand(4096, 6, device="cuda", generator=g)
    row = {}
    for t in (8, 11, 16, 32, 512, 1024, 2048, 4096):
        alt = MOE_SMALL if t <= 32 else MOE_LARGE
        row[t] = [round(rotating_graph_us(lambda i, t=t, c=c: op._experts(x[:t], wts[:t], ids[:t], None, False, c),
                                          copies=1, reps=8), 1) for c in ((None, None), alt)]
    _emit(out, {"threshold": "moe (fixed vs BLOCK_M 16 up to 32 tokens, 128 above; 6 pairs a token)",
                "us_fixed_vs_alt": row})


def probe_prefill(out) -> None:
    """The two prefill kernels that cost most with the flag (16 x 512 tokens): the MLA attention's pipelining
    depth at BLOCK_Q 4 on 8 warps (MMA row sums), and the MoE's grouped-GEMM tiles at BLOCK_M 128 and 8192
    tokens (the dual gate_up and the down GEMM varied one at a time). Same bits as the production choice? ms?"""
    from deepinfer.backend import MoESpec, RouterSpec
    from deepinfer.backends.nvidia.invariant.mla import mla_attention, qblocks_host
    from deepinfer.backends.nvidia.invariant.moe import InvariantMoE
    from deepinfer.backends.nvidia.invariant.moe_gemm import tile

    reqs, n = MLA_PREFILL_SHAPE[4:]
    g, cache, table, seq, q, qpe = _mla_prefill_inputs()
    qb = qblocks_host([n] * reqs, [0] * reqs, torch.device("cuda"), 4)
    base = None
    for stages in (3, 1, 2, 4):
        kw = {"two_stage": False, "block_q": 4, "num_warps": 8, "num_stages": stages}
        try:
            o = mla_attention(q, qpe, cache, table, seq, qb, 192 ** -0.5, **kw)
            ms = graph_ms(lambda kw=kw: mla_attention(q, qpe, cache, table, seq, qb, 192 ** -0.5, **kw), reps=10)
        except Exception as exc:
            _emit(out, {"prefill": f"mla block_q 4 warps 8 stages {stages}", "error": str(exc)[:160]})
            continue
        base = o if base is None else base
        _emit(out, {"prefill": f"mla block_q 4 warps 8 stages {stages}", "same_bits": bool(torch.equal(o, base)),
                    "ms": round(ms, 4)})
    router = RouterSpec(num_experts=64, top_k=6, topk_method="greedy", scoring_func="softmax", n_group=1,
                        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    op = InvariantMoE(MoESpec(router=router, hidden_size=2048, intermediate_size=1408))
    rnd = lambda *shape, s=0.02: (torch.randn(*shape, device="cuda", generator=g) * s).bfloat16()  # noqa: E731
    op.load_experts(rnd(64, 2816, 2048), rnd(64, 2048, 1408))
    assert op.fuse_shared_experts(rnd(5632, 2048), rnd(2048, 2816))
    gate = rnd(64, 2048).float()
    x = rnd(8192, 2048, s=1.0)
    run = lambda: op.forward_hidden(x, gate, None, shared_experts=lambda t: t)  # noqa: E731
    op.block_m_override = 128
    ref = run()
    dual0, down0 = tile(True), tile(False)
    cfgs = [("dual", {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}),
            ("dual", {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}),
            ("dual", {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}),
            ("dual", {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}),
            ("dual", {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}),
            ("dual", {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}),
            ("down", {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}),
            ("down", {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}),
            ("down", {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}),
            ("down", {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}),
            ("down", {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4})]
    for which, cfg in [(None, None)] + cfgs:
        op.tile = None if which is None else {"dual": cfg if which == "dual" else dual0,
                                              "down": cfg if which == "down" else down0}
        try:
            same = bool(torch.equal(run(), ref))
            us = rotating_graph_us(lambda i: run(), copies=1, reps=6)
        except Exception as exc:
            _emit(out, {"prefill": f"moe block_m 128 {which} {cfg}", "error": str(exc)[:160]})
            continue
        _emit(out, {"prefill": f"moe block_m 128 {which or 'default tiles'} {cfg or ''}", "same_bits": same,
                    "us_8192": round(us, 1)})
    op.block_m_override = op.tile = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--only", choices=("gemm", "mla", "moe", "thresholds", "prefill"), default=None)
    ap.add_argument("--mla-variants", default=None,
                    help="MLA only these 'block_q:warps' (MMA row sums), e.g. 4:8,2:4, beside the base (1:4)")
    args = ap.parse_args(argv)
    only_mla = None
    if args.mla_variants:
        only_mla = [(True, *map(int, v.split(":"))) for v in args.mla_variants.split(",")]
    out = open(args.json_out, "w") if args.json_out else None
    _emit(out, {"gpu": torch.cuda.get_device_name()})
    if args.only in (None, "mla"):
        probe_mla(out, only_mla)
    if args.only in (None, "moe"):
        probe_moe(out)
    if args.only in (None, "gemm"):
        probe_gemm(out)
    if args.only in (None, "thresholds"):
        probe_thresholds(out)
    if args.only in (None, "prefill"):
        probe_prefill(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
