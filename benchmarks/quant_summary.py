"""What a loaded model actually runs quantized, for the quantized throughput rows (issue 18), and the speed-up
table of a quantized throughput run against a bf16 one.

    python -m benchmarks.quant_summary BASE.jsonl QUANT.jsonl   # benchmarks.throughput --json-out files

`quant_summary(model)`: per linear method scheme the number of linears and their parameter bytes, per MoE layer the
routed experts' scheme (kept quantized in the op, or densified), the MLA kv_b_proj (absorbed dense by the
attention op whatever the checkpoint stores), and what stays in the compute dtype (LM head, embedding).
The goals it prints are issue 18's: fp8 W8A8 decode >= 1.4x bf16 at batch 256 and prefill >= 1.5x; int4 decode
>= 1.5x at batch 1.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

GOALS = {("fp8", 256): 1.4, ("fp8", "prefill"): 1.5, ("int4", 1): 1.5}


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def quant_summary(model: torch.nn.Module) -> dict:
    from deepinfer.models.layers.linear import Linear

    linears: Counter = Counter()
    lin_bytes: Counter = Counter()
    for m in model.modules():
        if isinstance(m, Linear) and m.method is not None:
            scheme = m.method.scheme
            linears[scheme] += 1
            lin_bytes[scheme] += _nbytes(*(p for p in m.parameters(recurse=False)))
    experts: Counter = Counter()
    expert_bytes = 0
    for m in model.modules():
        if type(m).__name__ == "MoELayer":
            q = getattr(m.op, "quant", None)
            if q is not None:
                experts[q.scheme] += 1
                expert_bytes += q.nbytes()
            else:
                experts["dense " + str(getattr(m.op, "w13", torch.empty(0)).dtype)] += 1
                expert_bytes += _nbytes(getattr(m.op, "w13", None), getattr(m.op, "w2", None))
    return {"linears": dict(linears), "linear_bytes": dict(lin_bytes), "moe_layers_experts": dict(experts),
            "routed_expert_bytes": expert_bytes,
            "kv_b_proj": "dense in the MLA op (absorbed at load; a quantized checkpoint's is dequantized once)"}


def _rows(path: str) -> tuple[dict, dict | None, dict[int, dict]]:
    meta, prefill, decode = {}, None, {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("bench") == "prefill":
                prefill = r
            elif r.get("bench") == "throughput" and "batch" in r:
                decode[r["batch"]] = r
            elif r.get("bench") == "throughput":
                meta = r
    return meta, prefill, decode


def compare(base: str, quant: str) -> list[dict]:
    """Rows (what, bf16, quantized, ratio, goal) of two benchmarks.throughput JSON-lines files."""
    return _compare(_rows(base), _rows(quant))


def _compare(base: tuple[dict, dict | None, dict[int, dict]], quant: tuple[dict, dict | None, dict[int, dict]]
             ) -> list[dict]:
    _, bp, bd = base
    qm, qp, qd = quant
    kind = "int4" if any(s.startswith("int4") for s in (qm.get("quant_summary") or {}).get("linears", {})) else "fp8"
    out = []
    if bp and qp:
        out.append({"what": "prefill tok/s", "bf16": bp["prefill_tok_s"], "quant": qp["prefill_tok_s"],
                    "goal": GOALS.get((kind, "prefill"))})
    for b in sorted(set(bd) & set(qd)):
        out.append({"what": f"decode tok/s batch {b}", "bf16": bd[b]["output_tok_s"], "quant": qd[b]["output_tok_s"],
                    "goal": GOALS.get((kind, b))})
    for r in out:
        r["ratio"] = r["quant"] / r["bf16"] if r["bf16"] else float("nan")
        r["met"] = None if r["goal"] is None else r["ratio"] >= r["goal"]
    return out


GEMM_CLASSES = ("moe_gemm", "dense_gemm")  # benchmarks/profile_region.py KERNEL_CLASSES: what quantization speeds up


def prefill_ceiling(base_profile: dict, quant_profile: dict, gemm_speedup: float = 2.0) -> dict:
    """Amdahl's bound on the prefill ratio from the two runs' device profiles (`--prefill-profile`: kernel ms by
    class, benchmarks/profile_region.py): the base's kernel sum over the quantized run's with its GEMMs at
    `gemm_speedup` x the base's GEMM time (2: fp8 against bf16 tensor-core peak) and every other kernel as measured.
    `free_quant` also drops the quantized run's activation-quant kernels. Kernel sums, not wall time: the device is
    busy most of a prefill step, so they bound the tok/s ratio up to the idle share (`busy` below)."""
    b, q = base_profile["classes_ms"], quant_profile["classes_ms"]
    base_gemm = sum(b.get(c, 0.0) for c in GEMM_CLASSES)
    quant_gemm = sum(q.get(c, 0.0) for c in GEMM_CLASSES)
    kb, kq = base_profile["kernel_sum_ms"], quant_profile["kernel_sum_ms"]
    rest = kq - quant_gemm
    best = rest + base_gemm / gemm_speedup
    return {"kernel_ratio": kb / kq, "base_gemm_share": base_gemm / kb, "quant_gemm_share": quant_gemm / kq,
            "gemm_ratio": base_gemm / quant_gemm if quant_gemm else float("nan"),
            "ceiling": kb / best, "ceiling_free_quant": kb / (best - q.get("act_quant", 0.0)),
            "rest_ms": {"base": kb - base_gemm, "quant": rest},
            "busy": {"base": base_profile["device_busy_ms"] / base_profile["wall_ms"],
                     "quant": quant_profile["device_busy_ms"] / quant_profile["wall_ms"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("quant")
    args = ap.parse_args(argv)
    base, quant = _rows(args.base), _rows(args.quant)
    rows = _compare(base, quant)
    for r in rows:
        print(json.dumps(r))
    bp, qp = base[1], quant[1]
    if bp and qp and "profile" in bp and "profile" in qp:
        c = prefill_ceiling(bp["profile"], qp["profile"])
        print(json.dumps({"prefill_ceiling": c}))
        print(f"prefill device profile: kernel sums {c['kernel_ratio']:.3f}x; GEMMs {c['base_gemm_share']:.0%} of "
              f"the base's kernel time, {c['quant_gemm_share']:.0%} of the quantized run's, {c['gemm_ratio']:.2f}x "
              f"faster; the rest {c['rest_ms']['base']:.1f} / {c['rest_ms']['quant']:.1f} ms. Ceiling with the "
              f"quantized GEMMs at 2x the base's and the rest as measured: {c['ceiling']:.3f}x "
              f"({c['ceiling_free_quant']:.3f}x with the act quant free)")
    print(f"{'':24} {'bf16':>10} {'quantized':>10} {'ratio':>6}  goal")
    for r in rows:
        goal = "" if r["goal"] is None else f">= {r['goal']}x: {'met' if r['met'] else 'MISSED'}"
        print(f"{r['what']:24} {r['bf16']:10.0f} {r['quant']:10.0f} {r['ratio']:6.2f}  {goal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
