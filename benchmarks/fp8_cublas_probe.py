"""Does cuBLAS's block-scaled fp8 GEMM (torch's scaled_mm with 1x128 activation and 128x128 weight scales, DeepSeek's
recipe) run on this GPU and torch, with which scale layouts, at what error and speed against bf16 cuBLAS and the
engine's Triton fp8 GEMM? (issue 18: the Triton W8A8 dense GEMM measured 0.40-0.74x of bf16 cuBLAS at 256 rows
and 0.52-0.85x at 16384 on the H200, 2026-12-04.)

    python -m benchmarks.fp8_cublas_probe [--m 64,256,16384] [--json out.jsonl]

Per V2-Lite dense shape and M: which (API, scale_a layout, scale_b layout) the op accepts (the first that runs is
timed), its relative error against the dequantized product in fp32, and device time (CUDA-graph replays, rotated
weight copies) of bf16 F.linear, the Triton fp8 GEMM (activation quant included, as the engine runs it) and cuBLAS
fp8 (activation quant included: the same quant kernel, then the GEMM).
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks import quant_gemm as qg


def _layouts(xs: torch.Tensor, ws: torch.Tensor):
    """(name, scale_a, scale_b) candidates: row-major as the engine stores them, and column-major ("outer dim
    major") copies."""
    col = lambda t: t.t().contiguous().t()  # noqa: E731
    kb = ws.shape[1]
    pad4 = torch.zeros(ws.shape[0], -(-kb // 4) * 4, dtype=ws.dtype, device=ws.device)
    pad4[:, :kb] = ws
    # b_t: the weight's [N/128, K/128] scales transposed (a view: [K/128, N/128], strides (1, K/128)), what
    # fp8_cublas.py passes; b_t_pad4: the same with K/128 padded to a multiple of 4
    return [("a_col,b_t", col(xs), ws.t()), ("a_col,b_t_pad4", col(xs), pad4.t()), ("a_col,b_row", col(xs), ws),
            ("a_row,b_t", xs, ws.t())]


def _apis():
    import torch.nn.functional as F

    out = []
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        st = F.ScalingType

        def v2(a, b, sa, sb):
            return F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, st.BlockWise128x128, output_dtype=torch.bfloat16)

        out.append(("F.scaled_mm", v2))

    def v1(a, b, sa, sb):
        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)

    out.append(("torch._scaled_mm", v1))
    return out


def probe(ms: list[int]) -> list[dict]:
    from deepinfer.backend import quantize_weight_fp8_block
    from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8
    from deepinfer.backends.nvidia.quant.fp8_cublas import blockscaled_linear
    from deepinfer.backends.nvidia.quant.fp8_gemm import fp8_block_gemm, fused_act_quant

    rows = []
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in qg.DENSE.items():
        if k % 128:
            print(json.dumps({"shape": name, "skip": f"K {k} is not a multiple of 128"}), flush=True)
            continue
        w = torch.randn(n, k, generator=g) * k**-0.5
        copies = qg._copies(n * k)
        layers = [qg._fp8_layer(w) for _ in range(copies)]
        wb = [w.to("cuda", torch.bfloat16) for _ in range(qg._copies(n * k * 2))]
        wq, ws = quantize_weight_fp8_block(w.cuda())
        w_ref = (wq.float() * ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k])
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_act_fp8(x)
            ref = (xq.float() * xs.repeat_interleave(128, 1)[:, :k]) @ w_ref.t()
            row = {"shape": name, "n": n, "k": k, "m": m}
            chosen = None
            for api, fn in _apis():
                for lay, sa, sb in _layouts(xs, ws):
                    try:
                        out = fn(xq, wq.t(), sa, sb)
                        torch.cuda.synchronize()
                    except Exception as exc:  # noqa: BLE001 - the probe's point: which forms this torch accepts
                        row.setdefault("refused", []).append(f"{api} {lay}: {str(exc).splitlines()[0][:160]}")
                        continue
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    row.setdefault("ran", []).append({"api": api, "layout": lay, "rel_err": err})
                    if chosen is None and err < 2e-2:
                        chosen = (api, fn, lay, sa.stride(), sb.stride())
            if chosen is not None:  # timed as the engine runs it (quant/fp8_cublas.py: rows and K blocks padded)
                row["cublas_api"], row["cublas_layout"] = chosen[0], chosen[2]

                def cublas(i, x=x, layers=layers):
                    lw = layers[i]
                    return blockscaled_linear(x, lw.weight, lw.weight_scale_k4, torch.bfloat16)

                row["cublas_us"] = qg.graph_us(cublas, copies)
            row["bf16_us"] = qg.graph_us(lambda i, x=x, wb=wb: torch.nn.functional.linear(x, wb[i]), len(wb))
            # the Triton GEMM as the engine ran it before cuBLAS (act quant then fp8_block_gemm; fused up to 64 rows)
            row["triton_fp8_us"] = qg.graph_us(lambda i, x=x, m=m, ls=layers: fp8_block_gemm(
                *((x, None) if fused_act_quant(m) else quantize_act_fp8(x)), ls[i].weight, ls[i].weight_scale_inv,
                torch.bfloat16), copies)
            rows.append(row)
            print(json.dumps(row), flush=True)
        layers = wb = None
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="64,256,16384")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), flush=True)
    rows = probe([int(v) for v in args.m.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{'shape':>15} {'M':>6} {'bf16 us':>9} {'triton fp8':>11} {'cublas fp8':>11} {'cublas x':>9}  layout")
    for r in rows:
        cu = r.get("cublas_us")
        print(f"{r['shape']:>15} {r['m']:>6} {r.get('bf16_us', float('nan')):9.1f} "
              f"{r.get('triton_fp8_us', float('nan')):11.1f} "
              f"{cu if cu is not None else float('nan'):11.1f} {r['bf16_us'] / cu if cu else float('nan'):9.2f}  "
              f"{r.get('cublas_api', '-')} {r.get('cublas_layout', (r.get('refused') or ['-'])[0])}")


if __name__ == "__main__":
    main()
