"""Tile sweep of the MoE grouped GEMMs per weight scheme, each GEMM timed on its own (issue 18).

    python -m benchmarks.moe_tile_sweep [--schemes bf16,fp8_w8a8,int4_awq] [--aligned-tokens 256,1024,16384]
                                        [--direct-tokens 1,4] [--block-ms 64,128] [--stages 3,4] [--group-ms 0,8]
                                        [--json out.jsonl] [--dry-run]

Why: quant_gemm's MoE table times the whole fused_moe at the engine's tiles; the fp8 W8A8 aligned GEMMs streamed
the experts at about half the copy bandwidth at 256 tokens (docs/quantization.md), and the int4 direct GEMMs at
batch 1 at about a quarter. This sweeps what the launch may choose, per GEMM: BLOCK_M (aligned: the padding each
expert's pairs get), and BLOCK_N, BLOCK_K, warps and stages (`cfg=` of aligned_gemm / direct_gemm), so a default
is picked from measurements rather than reasoned.

What is timed: V2-Lite's routed experts of one layer (64 x [2 x 1408, 2048]), top-6 random routing. Aligned:
gate_up (dual, SiLU-and-mul; under W8A8 it writes e4m3 + scales) and down (weighted) over the alignment made once.
Direct (the decode schedule): gate_up and down over 8 slots per token (6 routed + 2 stand-ins for the stacked
shared experts; all routed here). Device time from CUDA-graph replays (graph_timing.rotating_graph_us); each call
reads another of `copies` weight copies and another routing, so the decode sizes do not run from the L2 (one int4
call touches ~35 MB, under the H200's 50 MB L2).
Prints one JSON line per (scheme, schedule, tokens, GEMM, tile) and, per (scheme, schedule, tokens, GEMM), the
default's time, the best tile and the best's weight GB/s.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from benchmarks import quant_gemm as qg

ALIGNED_BLOCK_M = (16, 32, 64, 128)
ALIGNED_TILES = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4))]
DIRECT_TILES = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((64, 128, 256), (64, 128), (4, 8), (2, 4))]
# the int4 GEMV mainloop at one token (fused_moe_gemv.py): narrower tiles, more programs (no MMA minimum)
GEMV_TILES = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((16, 32, 64, 128), (64, 128), (2, 4), (1, 2))]
GROUP_MS: tuple[int, ...] = ()  # aligned tile orders to sweep (--group-ms); empty: the engine's
COPY_BYTES = 1 << 30  # weight copies up to this many bytes in all (at least 2)


def _block_ms(tokens: int) -> list[int]:
    per_expert = tokens * qg.TOP_K / qg.E
    return [b for b in ALIGNED_BLOCK_M if b <= max(32, 4 * per_expert) and (b >= 32 or per_expert <= 64)]


def _tiles(candidates, scheme: str, dual: bool, group: int, swap_ab: bool = False) -> list[dict]:
    """The tiles a scheme's kernel accepts: W8A8 steps one 128-wide K block and its e4m3 gate_up output needs
    BLOCK_N 128 per half; int4 tiles never straddle a group; a dual program's BN counts both halves (direct).
    swap_ab: W8A8 tiles also with their operands swapped (the fp8 wgmma below BLOCK_M 64)."""
    out = []
    for bn, bk, w, s in candidates:
        if scheme == "fp8_w8a8" and (bk != 128 or (dual and bn != 128)):
            continue
        if scheme == "int4_awq" and bk > group:
            continue
        out.append({"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": s})
        if swap_ab and scheme == "fp8_w8a8":
            out.append(dict(out[-1], swap_ab=True))
    return out


def _time(fn, copies: int, reps: int) -> float | None:
    try:
        return qg.graph_us(fn, copies, reps) if not qg.DRY else (fn(0), float("nan"))[1]
    except Exception as exc:  # a tile this GPU / Triton cannot compile (shared memory, registers)
        print(json.dumps({"error": str(exc)[:200]}), flush=True)
        return None


def _routing(tokens: int, slots: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(count):
        g = torch.Generator(device=qg.DEV).manual_seed(1000 * tokens + i)
        logits = torch.randn(tokens, qg.E, device=qg.DEV, generator=g)
        w, ids = torch.softmax(logits, -1).topk(slots, dim=-1)
        out.append((w.float().contiguous(), ids.contiguous()))
    return out


def _report(rows: list[dict], key: dict, default_us: float | None, nbytes_per_call: float) -> dict:
    ok = [r for r in rows if r["us"] is not None]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    summary = dict(key, default_us=default_us, best=best and {k: best[k] for k in ("block_m", "cfg", "us")},
                   best_weight_gbs=best and nbytes_per_call / best["us"] / 1e3,
                   default_weight_gbs=default_us and nbytes_per_call / default_us / 1e3, summary=True)
    print(json.dumps(summary), flush=True)
    return summary


def _with_group_ms(tiles: list[dict]) -> list[dict]:
    """Each tile at every --group-ms tile order (a cfg's "group_m", which aligned_gemm reads before the env)."""
    return [dict(t, group_m=g) for t in tiles for g in GROUP_MS] if GROUP_MS else tiles


def aligned(scheme: str, tokens: int, out: list[dict]) -> None:
    from deepinfer.backends.nvidia.fused_moe import pick_block_m, w8a8_down_block_m
    from deepinfer.backends.nvidia.fused_moe_config import gemm_config
    from deepinfer.backends.nvidia.fused_moe_gemm import aligned_gemm
    from deepinfer.backends.nvidia.moe_routing import moe_align
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8

    kw, nbytes = qg._moe_weights(scheme)
    q13 = {"scale": kw.get("w13_scale"), "scheme": kw.get("scheme"), "zeros": kw.get("w13_zeros"), "group_size": 128}
    q2 = {"scale": kw.get("w2_scale"), "scheme": kw.get("scheme"), "zeros": kw.get("w2_zeros"), "group_size": 128}
    n = tokens * qg.TOP_K
    _, ids = _routing(tokens, qg.TOP_K, 1)[0]
    x = torch.randn(tokens, qg.D, device=qg.DEV, dtype=qg._act_dtype())
    reps = 3 if tokens >= 4096 else 20
    touched = ids.unique().numel()
    bytes13 = nbytes * touched / qg.E * 2 / 3  # gate_up holds 2 of the 3 weight matrices
    bytes2 = nbytes * touched / qg.E / 3
    w8a8 = scheme == "fp8_w8a8"
    # the engine's rows per tile, per GEMM: W8A8 runs its down GEMM at 64 rows under 128-row gate_up tiles (over the
    # gate_up's alignment, subdivided; timed here over an alignment at 64, which pads each expert a little less)
    default_m = pick_block_m(n, qg.E, kw.get("scheme"), x.dtype)
    default_ms = {"gate_up": default_m, "down": w8a8_down_block_m(default_m) if w8a8 else default_m}
    rows13, rows2 = [], []
    default13 = default2 = None
    for block_m in _block_ms(tokens):
        sorted_ids, expert_ids, npad = moe_align(ids, qg.E, block_m)
        if w8a8:
            xq, xs = quantize_act_fp8(x)
            act = torch.empty((n, qg.INTER), dtype=torch.float8_e4m3fn, device=qg.DEV)
            act_s = torch.empty((n, qg.INTER // 128), dtype=torch.float32, device=qg.DEV)
            a13 = {"a_scale": xs, "out_scale": act_s, "act_dtype": x.dtype}
            a2 = {"a_scale": act_s, "act_dtype": x.dtype}
        else:
            xq, act = x, torch.empty((n, qg.INTER), dtype=x.dtype, device=qg.DEV)
            a13, a2 = {}, {}
        y = torch.empty((n, qg.D), dtype=x.dtype, device=qg.DEV)  # unweighted slots (the combine weights them)

        def gate_up(i, cfg, block_m=block_m, s=sorted_ids, e=expert_ids, p=npad, xq=xq, act=act, a13=a13):
            aligned_gemm(xq, kw["w13"], act, s, e, p, n, qg.TOP_K, block_m, dual=True, cfg=cfg, **a13, **q13)

        def down(i, cfg, block_m=block_m, s=sorted_ids, e=expert_ids, p=npad, act=act, y=y, a2=a2):
            aligned_gemm(act, kw["w2"], y, s, e, p, n, 1, block_m, cfg=cfg, **a2, **q2)

        gate_up(0, None)  # act holds real values for down's sweep
        for gemm, fn, rows, dual in (("gate_up", gate_up, rows13, True), ("down", down, rows2, False)):
            default_cfg = gemm_config(block_m, dual, kw.get("scheme"), 128)
            for cfg in _with_group_ms(_tiles(ALIGNED_TILES, scheme, dual, 128, swap_ab=block_m <= 32)):
                us = _time(lambda i, cfg=cfg, fn=fn: fn(i, cfg), 1, reps)
                row = {"scheme": scheme, "schedule": "aligned", "tokens": tokens, "gemm": gemm, "block_m": block_m,
                       "cfg": cfg, "us": us}
                rows.append(row)
                out.append(row)
                print(json.dumps(row), flush=True)
                if block_m == default_ms[gemm] and cfg == default_cfg:
                    if gemm == "gate_up":
                        default13 = us
                    else:
                        default2 = us
            if block_m == default_ms[gemm] and not any(r["cfg"] == default_cfg and r["block_m"] == block_m
                                                       for r in rows):
                # the default is not in the candidate list
                us = _time(lambda i, fn=fn, c=default_cfg: fn(i, c), 1, reps)
                if gemm == "gate_up":
                    default13 = us
                else:
                    default2 = us
    base = {"scheme": scheme, "schedule": "aligned", "tokens": tokens}
    out.append(_report(rows13, dict(base, gemm="gate_up", default_block_m=default_ms["gate_up"]), default13, bytes13))
    out.append(_report(rows2, dict(base, gemm="down", default_block_m=default_ms["down"]), default2, bytes2))


def direct(scheme: str, tokens: int, out: list[dict]) -> None:
    from deepinfer.backends.nvidia.fused_moe_config import direct_config
    from deepinfer.backends.nvidia.fused_moe_gemm import direct_gemm

    kw0, nbytes = qg._moe_weights(scheme)
    copies = max(2, min(8, COPY_BYTES // max(1, nbytes)))
    kws = [kw0] + [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw0.items()}
                   for _ in range(copies - 1)]
    slots = qg.TOP_K + 2
    routings = _routing(tokens, slots, copies)
    x = torch.randn(tokens, qg.D, device=qg.DEV, dtype=qg._act_dtype())
    act = torch.randn(tokens * slots, qg.INTER, device=qg.DEV, dtype=x.dtype)
    y = torch.empty((tokens * slots, qg.D), dtype=torch.float32, device=qg.DEV)
    sch = kw0.get("scheme")
    per_call = nbytes * (tokens * slots) / qg.E  # bytes of the experts one call reads (distinct for tokens 1)

    def q(kw, part):
        return {"scale": kw.get(f"{part}_scale"), "scheme": sch, "zeros": kw.get(f"{part}_zeros"), "group_size": 128}

    def gate_up(i, cfg):
        direct_gemm(x, kws[i]["w13"], None, act, routings[i][1], None, 0, slots, dual=True, cfg=cfg,
                    **q(kws[i], "w13"))

    def down(i, cfg):
        direct_gemm(act, kws[i]["w2"], None, y, routings[i][1], routings[i][0], 0, 1, dual=False, cfg=cfg,
                    **q(kws[i], "w2"))

    for gemm, fn, dual, share in (("gate_up", gate_up, True, 2 / 3), ("down", down, False, 1 / 3)):
        rows = []
        default_cfg = direct_config(dual, sch, 128)
        default_us = _time(lambda i, fn=fn, c=default_cfg: fn(i, c), copies, 20)
        cfgs = _tiles(DIRECT_TILES, scheme, dual, 128, swap_ab=True)
        if scheme == "int4_awq" and tokens == 1:
            cfgs += [dict(c, gemv=True) for c in _tiles(GEMV_TILES, scheme, dual, 128)]
        for cfg in cfgs:
            us = _time(lambda i, cfg=cfg, fn=fn: fn(i, cfg), copies, 20)
            row = {"scheme": scheme, "schedule": "direct", "tokens": tokens, "gemm": gemm, "block_m": 0, "cfg": cfg,
                   "us": us}
            rows.append(row)
            out.append(row)
            print(json.dumps(row), flush=True)
        out.append(_report(rows, {"scheme": scheme, "schedule": "direct", "tokens": tokens, "gemm": gemm},
                           default_us, per_call * share))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="bf16,fp8_w8a8,int4_awq")
    ap.add_argument("--aligned-tokens", default="256,1024,16384")
    ap.add_argument("--direct-tokens", default="1,4")
    ap.add_argument("--block-ms", default=None, help="aligned BLOCK_M values to sweep (default: those the tokens make "
                    "sensible out of 16, 32, 64, 128)")
    ap.add_argument("--stages", default="3,4", help="aligned num_stages values to sweep (each with every tile)")
    ap.add_argument("--group-ms", default=None, help="aligned tile orders to sweep (fused_moe_gemm._tile_order's "
                    "GROUP_M: 0 row tiles first, 8 the default); default: the engine's (DEEPINFER_MOE_GROUP_M)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), no timing")
    args = ap.parse_args(argv)
    global ALIGNED_TILES, DIRECT_TILES, ALIGNED_BLOCK_M, GEMV_TILES, GROUP_MS
    stages = tuple(int(v) for v in args.stages.split(","))
    ALIGNED_TILES = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((64, 128, 256), (64, 128), (4, 8), stages)]
    if args.group_ms:
        GROUP_MS = tuple(int(v) for v in args.group_ms.split(","))
    if args.dry_run:
        qg._dry_run_shapes()
        ALIGNED_BLOCK_M = (16,)
        ALIGNED_TILES = [(32, 16, 4, 1), (128, 128, 4, 1)]
        DIRECT_TILES = [(32, 16, 4, 1), (128, 128, 4, 1)]
        GEMV_TILES = [(16, 64, 2, 1)]
        args.aligned_tokens, args.direct_tokens = "40", "1"
    if args.block_ms:
        ALIGNED_BLOCK_M = tuple(int(v) for v in args.block_ms.split(","))
    out: list[dict] = []
    toks = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    for scheme in args.schemes.split(","):
        for t in toks(args.direct_tokens):
            direct(scheme, t, out)
        for t in toks(args.aligned_tokens):
            aligned(scheme, t, out)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.json:
        with open(args.json, "w") as f:
            for r in out:
                f.write(json.dumps(r) + "\n")
    print("\nper (scheme, schedule, tokens, GEMM): the default's us, the best tile, weight GB/s (default -> best)")
    for r in out:
        if r.get("summary"):
            b = r["best"] or {}
            print(f"{r['scheme']:>9} {r['schedule']:>7} {r['tokens']:>6} {r['gemm']:>7}: default "
                  f"{r['default_us'] or float('nan'):8.1f} us; best {b.get('us', float('nan')):8.1f} us at "
                  f"BLOCK_M {b.get('block_m')} {b.get('cfg')}; GB/s {r['default_weight_gbs'] or 0:5.0f} -> "
                  f"{r['best_weight_gbs'] or 0:5.0f}")


if __name__ == "__main__":
    main()
