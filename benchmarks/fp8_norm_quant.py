"""The fused RMSNorm + fp8 quant kernel against the two kernels it replaces (issue 18's fused act quant).

    python -m benchmarks.fp8_norm_quant [--rows 256,16384] [--hidden 2048] [--json out.jsonl] [--dry-run]

Why: on an H100 (2026-12-06, docs/perf-log/2026-12-06-session25-h100.md) the fused kernel
(`quant/rmsnorm_fp8.py`, on with DEEPINFER_FP8_EPILOGUE_QUANT=1) took 386 us a launch at 16,384 rows x 2,048,
where the add + norm it replaces took 86, so the fused act quant lost end to end. This times, per row count, the
fused kernel (`rms_norm_fp8`: add + norm + e4m3 quantization, both scale layouts) against `add_rms_norm` plus
`quantize_act_fp8` (column-major scales, what the cuBLAS fp8 GEMM reads), device time from CUDA-graph replays
(graph_timing.graph_ms), and checks that both give the same bits (the normed values and the e4m3 codes).
--dry-run: tiny shapes on the CPU under TRITON_INTERPRET=1 (the bits check only; the times print as 0).
"""

from __future__ import annotations

import argparse
import json
import os


def run(rows: int, hidden: int, device: str, dry_run: bool) -> dict:
    import torch

    from benchmarks.graph_timing import graph_ms
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8
    from deepinfer.backends.nvidia.quant.rmsnorm_fp8 import rms_norm_fp8
    from deepinfer.backends.nvidia.rmsnorm import add_rms_norm

    gen = torch.Generator(device="cpu").manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    res = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(device=device, dtype=torch.bfloat16)
    eps = 1e-6

    def fused():
        return rms_norm_fp8(x, res, w, eps)

    def apart():
        y, _ = add_rms_norm(x, res, w, eps)
        return quantize_act_fp8(y, scales_col_major=True)

    act, total = fused()
    y, ref_total = add_rms_norm(x, res, w, eps)
    q, s = quantize_act_fp8(y, scales_col_major=True)
    same = (torch.equal(act.x, y) and torch.equal(total, ref_total)
            and torch.equal(act.q[:rows].view(torch.uint8), q[:rows].view(torch.uint8))
            and torch.equal(act.s[:rows], s[:rows]))
    fused_us = 1e3 * graph_ms(fused, inner=10, dry_run=dry_run, dry_value=0.0)
    apart_us = 1e3 * graph_ms(apart, inner=10, dry_run=dry_run, dry_value=0.0)
    return {"bench": "fp8_norm_quant", "rows": rows, "hidden": hidden, "fused_us": round(fused_us, 2),
            "apart_us": round(apart_us, 2), "same_bits": bool(same)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="256,16384", help="comma list of token counts")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--json", default=None, help="append one JSON line per row count here")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        rows, hidden, device = [5], 256, "cpu"
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("benchmarks.fp8_norm_quant: no CUDA device (use --dry-run for the CPU check)")
        hidden, device = args.hidden, "cuda"
    results = [run(r, hidden, device, args.dry_run) for r in rows]
    for r in results:
        print(json.dumps(r), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
    print(f"{'rows':>6} {'fused us':>9} {'norm + quant us':>16} {'same bits':>9}")
    for r in results:
        print(f"{r['rows']:>6} {r['fused_us']:>9.1f} {r['apart_us']:>16.1f} {str(r['same_bits']):>9}")
    return 0 if all(r["same_bits"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
