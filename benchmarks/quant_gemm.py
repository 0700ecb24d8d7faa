"""bf16 vs fp8 W8A8 vs int4 linear GEMMs at DeepSeek-V2-Lite shapes on one GPU (docs/quantization.md).

    python benchmarks/quant_gemm.py [--m 1,16,64,256,1024] [--json out.json]

Shapes [N, K]: MLA q_proj 3072x2048, the dense MLP's gate_up 21888x2048 and down 2048x10944, o_proj 2048x2048.
bf16 is torch's F.linear (cuBLAS); fp8 is the activation quant kernel + the block-scaled GEMM
(deepinfer/backends/nvidia/quant); int4 is the AWQ-layout weight-only GEMM. Median of
triton.testing.do_bench, inputs rotated over 4 sets so the weights are not served from L2 alone.
Prints one JSON line per (shape, M) and a table last. Takes about a minute on an H200.
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = {"q_proj": (3072, 2048), "gate_up": (21888, 2048), "down": (2048, 10944), "o_proj": (2048, 2048)}


def main() -> None:
    import triton

    from deepinfer.backend import Int4Weight, quantize_weight_fp8_block
    from deepinfer.backends.nvidia.quant.linear_methods import TritonFp8W8A8Linear, TritonInt4Linear
    from deepinfer.checkpoints.awq_writer import pack_awq_cols, quantize_int4

    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,64,256,1024")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * k**-0.5
        wb = [w.bfloat16().cuda() for _ in range(4)]
        f8 = []
        for _ in range(4):
            lay = torch.nn.Module()
            q, s = quantize_weight_fp8_block(w)
            lay.weight, lay.weight_scale_inv, lay.bias = q.cuda(), s.cuda(), None
            TritonFp8W8A8Linear().process_weights(lay, torch.bfloat16)
            f8.append(lay)
        i4 = []  # group-128 int4 cannot hold a K that is not a multiple of 128 (V2-Lite's down_proj, K=10944)
        q4, z4, s4 = quantize_int4(w) if k % 128 == 0 else (None, None, None)
        for _ in range(4 if k % 128 == 0 else 0):
            lay = torch.nn.Module()
            lay.int4 = Int4Weight("awq", pack_awq_cols(q4).cuda(), pack_awq_cols(z4).cuda(), s4.cuda())
            lay.bias = lay.weight = None
            TritonInt4Linear("awq").process_weights(lay, torch.bfloat16)
            i4.append(lay)
        fp8m, i4m = TritonFp8W8A8Linear(), TritonInt4Linear("awq")
        for m in ms:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            it = {"i": 0}

            def nxt():
                it["i"] = (it["i"] + 1) % 4
                return it["i"]

            t_bf = triton.testing.do_bench(lambda: torch.nn.functional.linear(xs[nxt()], wb[it["i"]]),
                                           return_mode="median")
            t_f8 = triton.testing.do_bench(lambda: fp8m.apply(f8[nxt()], xs[it["i"]]), return_mode="median")
            t_i4 = (triton.testing.do_bench(lambda: i4m.apply(i4[nxt()], xs[it["i"]]), return_mode="median")
                    if i4 else float("nan"))
            row = {"shape": name, "n": n, "k": k, "m": m, "bf16_us": t_bf * 1e3, "fp8_us": t_f8 * 1e3,
                   "int4_us": t_i4 * 1e3}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'shape':8} {'M':>5} {'bf16 us':>9} {'fp8 us':>9} {'int4 us':>9} {'fp8 x':>6} {'int4 x':>6}")
    for r in rows:
        print(f"{r['shape']:8} {r['m']:5d} {r['bf16_us']:9.1f} {r['fp8_us']:9.1f} {r['int4_us']:9.1f} "
              f"{r['bf16_us'] / r['fp8_us']:6.2f} {r['bf16_us'] / r['int4_us']:6.2f}")


if __name__ == "__main__":
    main()
