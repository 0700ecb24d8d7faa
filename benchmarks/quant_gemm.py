"""bf16 vs fp8 W8A8 vs int4 GEMMs at DeepSeek-V2-Lite shapes on one GPU: the dense linears and the routed experts'
grouped GEMMs (docs/quantization.md "Speed").

    python -m benchmarks.quant_gemm [--only dense,moe] [--m 1,16,64,256,1024,16384] [--tokens 1,64,256,1024,16384]
                                    [--sweep] [--splits 1,2,4,8] [--shapes o_proj,...] [--json out.jsonl]

Times are device time: `reps` calls captured in one CUDA graph and replayed, divided by reps (the engine runs
decode under CUDA graphs; timing eager calls measures Triton's Python launch path, 20-60 us per launch, which is
what the 2026-12-01 / 12-03 tables of this benchmark measured for the small shapes). Every call in the graph
reads another copy of the weight (copies > 256 MB in all, several times the L2), as a decode step streams each
weight once. The eager median (triton.testing.do_bench over the same rotation) is kept as a second column.

dense: bf16 = F.linear (cuBLAS); fp8 = TritonFp8W8A8Linear.apply (the act quant fused into the GEMM up to
DEEPINFER_FP8_FUSED_ACT_QUANT_MAX_M rows, a separate kernel above); int4 = AWQ, group 128 (64 where K is not a
multiple of 128: V2-Lite's dense down_proj, K 10944), both paths timed: `int4 k` the in-register kernel,
`int4 dq` dequantize-then-cuBLAS (the engine switches at DEEPINFER_INT4_DEQUANT_MIN_M).
moe: fused_moe (alignment + both grouped GEMMs + combine, routing excluded) over 64 experts, top-6, hidden
2048, intermediate 1408, random uniform routing: bf16, fp8 W8A16 (fp8_block), fp8 W8A8 (fp8_w8a8), int4 AWQ g128.
--sweep: per (dense shape, M) also the best of a small tile list for the fp8 and int4 kernels (`tile=`); for fp8
over the K splits of --splits too (quant/split_k.py, `split=`), twice: x quantized by the separate kernel (its time
included, as in the `fp8` column above the fused size) and, up to 256 rows, x quantized inside the GEMM.
--shapes: only these dense shapes (DENSE's names; q_kv_a is q_proj and kv_a_proj fused, as the engine runs them).
Prints one JSON line per row and a table last.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.graph_timing import rotating_graph_us

DENSE = {"q_proj": (3072, 2048), "kv_a_proj": (576, 2048), "q_kv_a": (3648, 2048), "o_proj": (2048, 2048),
         "shared_gate_up": (5632, 2048),
         "shared_down": (2048, 2816), "dense_gate_up": (21888, 2048), "dense_down": (2048, 10944)}
E, TOP_K, D, INTER = 64, 6, 2048, 1408
ROTATE_BYTES = 256 << 20
DEV = "cuda"
DRY = False  # --dry-run: tiny shapes on the CPU under the Triton interpreter, every code path once, no timing


def _dry_run_shapes() -> None:
    """Shapes small enough for the interpreter that still take every path: a K that is not a multiple of 128
    (int4 group 64), a partial fp8 block, I a multiple of 128 (the W8A8 gate_up epilogue's channel groups)."""
    global DENSE, E, TOP_K, D, INTER, DEV, DRY
    DENSE = {"q_proj": (96, 256), "dense_down": (64, 320)}
    E, TOP_K, D, INTER, DEV, DRY = 4, 2, 128, 128, "cpu", True


def graph_us(fn, copies: int, reps: int = 20) -> float:
    """Device time per call: reps calls fn(i) (i selects the weight copy) captured in one CUDA graph
    (benchmarks/graph_timing.py)."""
    if DRY:
        fn(0)
        return float("nan")
    return rotating_graph_us(fn, copies, reps)


def eager_us(fn, copies: int) -> float:
    import triton

    if DRY:
        return float("nan")

    it = {"i": 0}

    def step():
        it["i"] = (it["i"] + 1) % copies
        fn(it["i"])

    return triton.testing.do_bench(step, return_mode="median") * 1000


def _copies(nbytes: int) -> int:
    return max(2, min(16, ROTATE_BYTES // max(1, nbytes)))


def _fp8_layer(w: torch.Tensor):
    from deepinfer.backend import quantize_weight_fp8_block
    from deepinfer.backends.nvidia.quant.linear_methods import TritonFp8W8A8Linear

    lay = torch.nn.Module()
    q, s = quantize_weight_fp8_block(w)
    lay.weight, lay.weight_scale_inv, lay.bias = q.to(DEV), s.to(DEV), None
    TritonFp8W8A8Linear().process_weights(lay, _act_dtype())
    return lay


def _int4_layer(w: torch.Tensor, group: int):
    from deepinfer.backend import Int4Weight
    from deepinfer.backends.nvidia.quant.linear_methods import TritonInt4Linear
    from deepinfer.checkpoints.awq_writer import pack_awq_cols, quantize_int4

    q, z, s = quantize_int4(w, group)
    lay = torch.nn.Module()
    lay.int4 = Int4Weight("awq", pack_awq_cols(q).to(DEV), pack_awq_cols(z).to(DEV), s.to(DEV), group_size=group)
    lay.bias = lay.weight = None
    TritonInt4Linear("awq").process_weights(lay, _act_dtype())
    return lay


FP8_TILES = [(16, 32, 4, 5), (16, 64, 4, 4), (32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4),
             (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3)]
INT4_TILES = [(16, 32, 4, 4), (16, 64, 4, 4), (32, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3)]


def _sweep(fn_tile, tiles, m: int, copies: int, splits: tuple[int, ...] = (1,)) -> dict | None:
    """The fastest (tile, split) (graph time) of the tiles whose BLOCK_M suits m (at 64 rows and more, no tile
    narrower than 64 rows: the MMA's warpgroup tile); None if none compiled. fn_tile(i, tile, split)."""
    best = None
    for t in tiles:
        if t[0] > max(16, 2 * m) or (m >= 64 and t[0] < 64):
            continue
        for sp in splits:
            try:
                us = graph_us(lambda i, t=t, sp=sp: fn_tile(i, t, sp), copies)
            except Exception as exc:  # a tile this GPU / Triton cannot compile (shared memory, registers)
                print(json.dumps({"tile": t, "split": sp, "error": str(exc)[:160]}), flush=True)
                continue
            if best is None or us < best["us"]:
                best = {"tile": list(t), "split": sp, "us": us}
    return best


def dense_rows(ms: list[int], sweep: bool, splits: tuple[int, ...] = (1,),
               shapes: list[str] | None = None) -> list[dict]:
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8
    from deepinfer.backends.nvidia.quant.fp8_gemm import fp8_block_gemm, fused_act_quant
    from deepinfer.backends.nvidia.quant.int4_gemm import dequant_min_m, int4_gemm
    from deepinfer.backends.nvidia.quant.linear_methods import TritonFp8W8A8Linear

    rows = []
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in DENSE.items():
        if shapes and name not in shapes:
            continue
        w = torch.randn(n, k, generator=g) * k**-0.5
        copies = _copies(n * k * 2)
        wb = [w.to(DEV, _act_dtype()) for _ in range(copies)]
        f8 = [_fp8_layer(w) for _ in range(_copies(n * k))]
        group = 128 if k % 128 == 0 else 64
        i4 = [_int4_layer(w, group) for _ in range(_copies(n * k // 2))]
        fp8m = TritonFp8W8A8Linear()
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=_act_dtype())
            ops = {
                "bf16": (lambda i: torch.nn.functional.linear(x, wb[i]), len(wb)),
                "fp8": (lambda i: fp8m.apply(f8[i], x), len(f8)),
                "int4_k": (lambda i: int4_gemm(x, i4[i].qweight_nk, i4[i].zeros_ng, i4[i].scales_ng, None, group,
                                               dequant=False), len(i4)),
                "int4_dq": (lambda i: int4_gemm(x, i4[i].qweight_nk, i4[i].zeros_ng, i4[i].scales_ng, None, group,
                                                dequant=True), len(i4)),
            }
            row = {"part": "dense", "shape": name, "n": n, "k": k, "m": m, "int4_group": group,
                   "fp8_fused_act_quant": fused_act_quant(m)}
            for key, (fn, c) in ops.items():
                row[f"{key}_us"] = graph_us(fn, c)
                row[f"{key}_eager_us"] = eager_us(fn, c)
            if m == 1:  # the opt-in one-token GEMV (DEEPINFER_INT4_GEMV; int4_gemm.py)
                row["int4_gemv_us"] = graph_us(lambda i: int4_gemm(x, i4[i].qweight_nk, i4[i].zeros_ng,
                                                                   i4[i].scales_ng, None, group, gemv=True), len(i4))
            row["int4_path"] = "dq" if m >= dequant_min_m() else "k"  # what TritonInt4Linear.apply runs
            row["int4_us"] = row[f"int4_{row['int4_path']}_us"]
            if sweep:
                row["fp8_sep_best"] = _sweep(lambda i, t, sp: fp8_block_gemm(
                    *quantize_act_fp8(x), f8[i].weight, f8[i].weight_scale_inv, _act_dtype(), tile=t, split=sp),
                    FP8_TILES, m, len(f8), splits)
                if m <= 256:
                    row["fp8_fused_best"] = _sweep(lambda i, t, sp: fp8_block_gemm(
                        x, None, f8[i].weight, f8[i].weight_scale_inv, _act_dtype(), tile=t, split=sp),
                        FP8_TILES, m, len(f8), splits)
                row["int4_best"] = _sweep(lambda i, t, _sp: int4_gemm(
                    x, i4[i].qweight_nk, i4[i].zeros_ng, i4[i].scales_ng, None, group, dequant=False, tile=t),
                    INT4_TILES, m, len(i4))
            rows.append(row)
            print(json.dumps(row), flush=True)
        wb = f8 = i4 = None  # free this shape's copies before the next
        torch.cuda.empty_cache()
    return rows


def _act_dtype() -> torch.dtype:
    return torch.float16 if DRY else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong (NOTES.md)


def _moe_weights(scheme: str):
    """(fused_moe weight kwargs, weight bytes) for V2-Lite's 64 experts of one layer in `scheme`."""
    from deepinfer.backend import quantize_weight_fp8_block

    g = torch.Generator(device=DEV).manual_seed(1)
    w13 = torch.randn(E, 2 * INTER, D, device=DEV, generator=g) * D**-0.5
    w2 = torch.randn(E, D, INTER, device=DEV, generator=g) * INTER**-0.5
    if scheme == "bf16":
        kw = {"w13": w13.to(_act_dtype()), "w2": w2.to(_act_dtype())}
    elif scheme in ("fp8_block", "fp8_w8a8"):
        q13, s13, q2, s2 = [], [], [], []
        for e in range(E):
            (qg, sg), (qu, su) = quantize_weight_fp8_block(w13[e, :INTER]), quantize_weight_fp8_block(w13[e, INTER:])
            qd, sd = quantize_weight_fp8_block(w2[e])
            q13.append(torch.cat([qg, qu]))
            s13.append(torch.cat([sg, su]))
            q2.append(qd)
            s2.append(sd)
        kw = {"w13": torch.stack(q13), "w2": torch.stack(q2), "scheme": scheme, "w13_scale": torch.stack(s13),
              "w2_scale": torch.stack(s2)}
    else:  # int4 AWQ g128, in the experts' row layout (what the loader's repacking produces)
        def rows(w):  # [E, N, K] -> (packed uint8 [E, N, K/2], zeros uint8, scales fp16 [E, N, K/128])
            wg = w.float().view(E, w.shape[1], -1, 128)
            lo, hi = wg.amin(-1), wg.amax(-1)
            s = ((hi - lo).clamp(min=1e-5) / 15).half()
            z = torch.round(-lo / s.float()).clamp(0, 15)
            q = torch.clamp(torch.round(wg / s.float()[..., None]) + z[..., None], 0, 15).to(torch.uint8)
            q = q.view(E, w.shape[1], -1)
            return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous(), z.to(torch.uint8).contiguous(), s.contiguous()

        (p13, z13, s13), (p2, z2, s2) = rows(w13), rows(w2)
        kw = {"w13": p13, "w2": p2, "scheme": "int4_awq", "w13_scale": s13, "w2_scale": s2, "w13_zeros": z13,
              "w2_zeros": z2, "group_size": 128}
    nbytes = sum(t.numel() * t.element_size() for t in kw.values() if isinstance(t, torch.Tensor))
    return kw, nbytes


def moe_rows(tokens: list[int]) -> list[dict]:
    """The routed experts of one layer per scheme and token count (the bf16 row in fp16 under --dry-run)."""
    from deepinfer.backends.nvidia.fused_moe import counters_for, fused_moe, use_direct

    counters = counters_for(D, DEV)
    routing = {}
    for t in tokens:
        logits = torch.randn(t, E, device=DEV, generator=torch.Generator(device=DEV).manual_seed(t))
        w, ids = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
        routing[t] = (torch.randn(t, D, device=DEV, dtype=_act_dtype()), w.float(), ids)
    results: dict[int, dict] = {t: {"part": "moe", "tokens": t, "direct": use_direct(t, TOP_K)} for t in tokens}
    for scheme in ("bf16", "fp8_block", "fp8_w8a8", "int4_awq"):
        kw, nbytes = _moe_weights(scheme)
        for t in tokens:
            x, w, ids = routing[t]
            touched = ids.unique().numel()
            fn = lambda i, x=x, w=w, ids=ids: fused_moe(x, topk_weights=w, topk_ids=ids, counters=counters, **kw)  # noqa: E731
            reps = 3 if t >= 4096 else 20
            us = graph_us(fn, 1, reps)
            r = results[t]
            r[f"{scheme}_us"] = us
            r[f"{scheme}_eager_us"] = eager_us(fn, 1)
            r[f"{scheme}_weight_gbs"] = nbytes * touched / E / us / 1e3  # touched experts' bytes per second
            r[f"{scheme}_tflops"] = 2 * 3 * D * INTER * t * TOP_K / us / 1e6
            print(json.dumps({"part": "moe", "scheme": scheme, "tokens": t, "us": us,
                              "weight_gbs": r[f"{scheme}_weight_gbs"]}), flush=True)
        kw = None
        torch.cuda.empty_cache()
    rows = list(results.values())
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="dense,moe")
    ap.add_argument("--m", default="1,16,64,256,1024,16384")
    ap.add_argument("--tokens", default="1,64,256,1024,16384")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--splits", default="1", help="K splits the fp8 sweep tries (comma list)")
    ap.add_argument("--shapes", default="", help="only these dense shapes (comma list of DENSE's names)")
    ap.add_argument("--json", default=None, help="write every row as JSON lines here")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), no timing")
    args = ap.parse_args(argv)
    if args.dry_run:
        _dry_run_shapes()
        args.m, args.tokens = "1,70", "1,40"  # M 70: the separate act quant; 40 x top-2 > 64 pairs: aligned
    parts = args.only.split(",")
    rows = []
    if "dense" in parts:
        rows += dense_rows([int(v) for v in args.m.split(",")], args.sweep,
                           tuple(int(v) for v in args.splits.split(",")), [v for v in args.shapes.split(",") if v])
    if "moe" in parts:
        rows += moe_rows([int(v) for v in args.tokens.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    gpu = "dry run (CPU, interpreter)" if DRY else torch.cuda.get_device_name()
    print(f"\n{gpu}: device time per call, CUDA-graph replays (eager median in brackets)")
    dense = [r for r in rows if r["part"] == "dense"]  # int4 x: the path the engine takes at that M
    if dense:
        print(f"{'shape':>15} {'M':>6} {'bf16 us':>16} {'fp8 us':>16} {'int4 k us':>16} {'int4 dq us':>16} "
              f"{'fp8 x':>6} {'int4 x':>6}")
        for r in dense:
            cell = lambda key: f"{r[key + '_us']:7.1f} [{r[key + '_eager_us']:6.1f}]"  # noqa: E731
            print(f"{r['shape']:>15} {r['m']:>6} {cell('bf16'):>16} {cell('fp8'):>16} {cell('int4_k'):>16} "
                  f"{cell('int4_dq'):>16} {r['bf16_us'] / r['fp8_us']:6.2f} {r['bf16_us'] / r['int4_us']:6.2f}")
            if "int4_gemv_us" in r:
                print(f"{'':>15} {'':>6} int4 GEMV (DEEPINFER_INT4_GEMV): {r['int4_gemv_us']:.1f} us")
            for key in ("fp8_sep_best", "fp8_fused_best", "int4_best"):
                if r.get(key):
                    print(f"{'':>15} {'':>6} best {key[:-5]} tile {r[key]['tile']} split {r[key]['split']}: "
                          f"{r[key]['us']:.1f} us")
    moe = [r for r in rows if r["part"] == "moe"]
    if moe:
        print(f"\nrouted experts ({E} x [2x{INTER}, {D}], top-{TOP_K}): us per call [eager], weight GB/s of touched experts")
        print(f"{'tokens':>6} {'bf16':>22} {'fp8 W8A16':>22} {'fp8 W8A8':>22} {'int4 W4A16':>22} "
              f"{'w8a8 x':>7} {'int4 x':>7}")
        for r in moe:
            cell = lambda s: f"{r[s + '_us']:8.1f} [{r[s + '_eager_us']:7.1f}] {r[s + '_weight_gbs']:4.0f}"  # noqa: E731
            print(f"{r['tokens']:>6} {cell('bf16'):>22} {cell('fp8_block'):>22} {cell('fp8_w8a8'):>22} "
                  f"{cell('int4_awq'):>22} {r['bf16_us'] / r['fp8_w8a8_us']:7.2f} {r['bf16_us'] / r['int4_awq_us']:7.2f}")


if __name__ == "__main__":
    main()
