"""int4 decode GEMMs at V2-Lite shapes: the CUDA C++ GEMVs (csrc/cuda/int4_gemv.cu) against the Triton kernels.

Device time per call from CUDA-graph replays over enough weight copies that the L2 serves none of them
(benchmarks/graph_timing.py), so each row is the kernel reading its weights from DRAM, as in a decode step.
Rows: the dense linears (q_proj 3072 x 2048, kv_a 576 x 2048, o_proj 2048 x 2048) at 1 / 4 / 8 tokens through
quant/int4_gemm.int4_gemm with cuda=False / True, and one token's experts (64 routed, top-6, 2 stacked shared
experts; D 2048, I 1408) through fused_moe's direct schedule with DEEPINFER_INT4_CUDA_GEMV=0 / 1, and the same
experts with a GPTQ act-order gate_up, as stored (w13_g_idx: the Triton GEMMs gather zero points and scales per input
channel) and sorted by group (w13_perm, the nvidia op's layout since session 33: x gathered in that order, by the
Triton GEMMs and by the CUDA GEMVs); no shared experts stacked, as the op runs them. GPU only.

    python -m benchmarks.int4_cuda_gemv [--tokens 1,4,16] [--json out.jsonl]

--ncu launches each CUDA kernel a few times with no timing and no graphs (one weight copy), as a target for Nsight
Compute, which replays every launch from a flushed cache and reads its counters:

    ncu --clock-control none --kernel-name regex:int4_ --section SpeedOfLight ... python -m benchmarks.int4_cuda_gemv --ncu
"""

from __future__ import annotations

import argparse
import json
import os

GROUP = 128
DENSE = {"q_proj": (3072, 2048), "kv_a": (576, 2048), "o_proj": (2048, 2048)}
HIDDEN, INTER, ROUTED, SHARED, TOP_K = 2048, 1408, 64, 2, 6


def _copies(nbytes: int) -> int:
    return max(2, (512 << 20) // nbytes)  # > the L2 (50 MB) many times over


def _dense_sets(n: int, k: int, copies: int):
    import torch

    g = torch.Generator().manual_seed(0)
    sets = []
    for _ in range(copies):
        w = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        z = torch.randint(0, 16, (k // GROUP, n), generator=g, dtype=torch.uint8)
        s = (torch.rand(k // GROUP, n, generator=g) * 0.01 + 0.001).half()
        sets.append((w.cuda(), z.t().contiguous().cuda(), s.t().contiguous().cuda()))  # the loader's layout
    return sets


def _expert_sets(copies: int):
    import torch

    from deepinfer.backend import QuantizedExperts

    g = torch.Generator().manual_seed(1)
    e = ROUTED + SHARED
    sets = []
    for _ in range(copies):
        w13 = torch.randint(0, 256, (e, 2 * INTER, HIDDEN // 2), generator=g, dtype=torch.uint8)
        w2 = torch.randint(0, 256, (e, HIDDEN, INTER // 2), generator=g, dtype=torch.uint8)
        z13 = torch.randint(0, 16, (e, 2 * INTER, HIDDEN // GROUP), generator=g, dtype=torch.uint8)
        z2 = torch.randint(0, 16, (e, HIDDEN, INTER // GROUP), generator=g, dtype=torch.uint8)
        s13 = (torch.rand(e, 2 * INTER, HIDDEN // GROUP, generator=g) * 0.01 + 0.001).half()
        s2 = (torch.rand(e, HIDDEN, INTER // GROUP, generator=g) * 0.01 + 0.001).half()
        sets.append(QuantizedExperts("int4_awq", w13.cuda(), s13.cuda(), w2.cuda(), s2.cuda(), z13.cuda(), z2.cuda(),
                                     GROUP))
    return sets


def run(args) -> list[dict]:
    import torch

    from benchmarks.graph_timing import rotating_graph_us
    from deepinfer.backends.nvidia.fused_moe import counters_for, fused_moe
    from deepinfer.backends.nvidia.quant.int4_gemm import int4_gemm

    rows = []
    for name, (n, k) in DENSE.items():
        copies = _copies(n * k // 2)
        sets = _dense_sets(n, k, copies)
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda").bfloat16()
            for cuda, warps in ((False, 4), (True, 4), (True, 8)):  # DEEPINFER_INT4_CUDA_DENSE_WARPS
                os.environ["DEEPINFER_INT4_CUDA_DENSE_WARPS"] = str(warps)
                fn = lambda i, c=cuda, x=x, ws=sets, nc=copies: int4_gemm(x, *ws[i % nc], None, GROUP, cuda=c)
                us = rotating_graph_us(fn, copies, reps=min(40, 4 * copies))
                rows.append({"op": name, "tokens": m, "kernel": f"cuda {warps} warps" if cuda else "triton",
                             "us": round(us, 2), "weight_gbs": round(n * k / 2 / us / 1e3, 1)})
            os.environ.pop("DEEPINFER_INT4_CUDA_DENSE_WARPS", None)
    per_copy = (ROUTED + SHARED) * 3 * INTER * HIDDEN // 2
    copies = max(2, (1 << 30) // per_copy)
    experts = _expert_sets(copies)
    x = torch.randn(1, HIDDEN, device="cuda").bfloat16()
    ids = torch.randperm(ROUTED, device="cuda")[:TOP_K].view(1, TOP_K)
    wts = torch.rand(1, TOP_K, device="cuda") + 0.1
    counters = counters_for(HIDDEN, "cuda")
    active = (TOP_K + SHARED) * 3 * INTER * HIDDEN // 2
    for cuda, split in (("0", "4"), ("1", "4"), ("1", "8")):
        os.environ["DEEPINFER_INT4_CUDA_GEMV"] = cuda
        os.environ["DEEPINFER_INT4_CUDA_SPLIT_K"] = split

        def fn(i):
            q = experts[i % copies]
            return fused_moe(x, q.w13, q.w2, wts, ids, direct=True, scheme="int4_awq", w13_scale=q.w13_scale,
                             w2_scale=q.w2_scale, w13_zeros=q.w13_zeros, w2_zeros=q.w2_zeros, group_size=GROUP,
                             stacked_shared=SHARED, counters=counters)

        us = rotating_graph_us(fn, copies, reps=min(40, 4 * copies))
        rows.append({"op": "moe_b1 (gate_up + down)", "tokens": 1,
                     "kernel": f"cuda split {split}" if cuda == "1" else "triton",
                     "us": round(us, 2), "weight_gbs": round(active / us / 1e3, 1)})
    os.environ.pop("DEEPINFER_INT4_CUDA_GEMV", None)
    os.environ.pop("DEEPINFER_INT4_CUDA_SPLIT_K", None)
    g = torch.Generator().manual_seed(2)
    g_idx = torch.stack([torch.argsort(torch.randperm(HIDDEN, generator=g)) // GROUP
                         for _ in range(ROUTED + SHARED)]).to(torch.int32).cuda()

    # the sorted layout's order (its weight bytes are the contiguous experts': the speed does not depend on them)
    perm = torch.argsort(g_idx[:ROUTED].long(), dim=1, stable=True).to(torch.int32).contiguous()

    def routed_only(i, layout: str):
        q = experts[i % copies]
        order = {"w13_g_idx": g_idx[:ROUTED]} if layout == "act-order" else {
            "w13_perm": perm} if layout == "act-order sorted" else {}
        return fused_moe(x, q.w13[:ROUTED], q.w2[:ROUTED], wts, ids, direct=True, scheme="int4_gptq",
                         w13_scale=q.w13_scale[:ROUTED], w2_scale=q.w2_scale[:ROUTED],
                         w13_zeros=q.w13_zeros[:ROUTED], w2_zeros=q.w2_zeros[:ROUTED], group_size=GROUP,
                         counters=counters, **order)

    routed_bytes = TOP_K * 3 * INTER * HIDDEN // 2
    for cuda, layouts in (("0", ("contiguous groups", "act-order", "act-order sorted")),
                          ("1", ("contiguous groups", "act-order sorted"))):  # (as stored: no CUDA GEMV)
        os.environ["DEEPINFER_INT4_CUDA_GEMV"] = cuda
        for layout in layouts:
            us = rotating_graph_us(lambda i, a=layout: routed_only(i, a), copies, reps=min(40, 4 * copies))
            rows.append({"op": f"moe_b1 routed only, {layout}", "tokens": 1,
                         "kernel": "cuda split 4" if cuda == "1" else "triton", "us": round(us, 2),
                         "weight_gbs": round(routed_bytes / us / 1e3, 1)})
    os.environ.pop("DEEPINFER_INT4_CUDA_GEMV", None)
    from deepinfer.backends.nvidia.quant import int4_cuda

    ext = int4_cuda.ext()
    act = ext.int4_moe_gate_up(x, experts[0].w13, experts[0].w13_zeros, experts[0].w13_scale, ids, SHARED, 1)
    for split in (1, 2, 4, 8):  # DEEPINFER_INT4_CUDA_SPLIT_K
        for part, nbytes in (("gate_up", 2 * INTER * HIDDEN // 2), ("down", HIDDEN * INTER // 2)):
            def fn(i, part=part, split=split):
                q = experts[i % copies]
                if part == "gate_up":
                    return ext.int4_moe_gate_up(x, q.w13, q.w13_zeros, q.w13_scale, ids, SHARED, split)
                return ext.int4_moe_down(act, q.w2, q.w2_zeros, q.w2_scale, ids, wts, SHARED, split)

            us = rotating_graph_us(fn, copies, reps=min(40, 4 * copies))
            rows.append({"op": f"moe_b1 {part} alone", "tokens": 1, "kernel": f"cuda split {split}",
                         "us": round(us, 2), "weight_gbs": round((TOP_K + SHARED) * nbytes / us / 1e3, 1)})
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def ncu_targets(launches: int = 2) -> None:
    """Each CUDA int4 kernel at V2-Lite's decode shapes, `launches` times: the dense GEMV (o_proj and q_proj at one
    token, 4 and 8 warps a tile) and one token's experts' gate_up and down at every DEEPINFER_INT4_CUDA_SPLIT_K (1, 2, 4, 8)."""
    import torch

    from deepinfer.backends.nvidia.quant import int4_cuda

    ext = int4_cuda.ext()
    for name in ("o_proj", "q_proj"):
        n, k = DENSE[name]
        (w, z, s), = _dense_sets(n, k, 1)
        x = torch.randn(1, k, device="cuda").bfloat16()
        for warps in (4, 8):
            for _ in range(launches):
                ext.int4_gemv(x, w, z, s, None, warps)
    q, = _expert_sets(1)
    x = torch.randn(1, HIDDEN, device="cuda").bfloat16()
    ids = torch.randperm(ROUTED, device="cuda")[:TOP_K].view(1, TOP_K)
    wts = (torch.rand(1, TOP_K, device="cuda") + 0.1).float()
    for split in (1, 2, 4, 8):
        for _ in range(launches):
            act = ext.int4_moe_gate_up(x, q.w13, q.w13_zeros, q.w13_scale, ids, SHARED, split)
            ext.int4_moe_down(act, q.w2, q.w2_zeros, q.w2_scale, ids, wts, SHARED, split)
    torch.cuda.synchronize()
    print("ncu targets: dense o_proj, q_proj at 4 and 8 warps; moe gate_up + down at split 1, 2, 4, 8;", launches, "launches each")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,8", type=lambda v: [int(t) for t in v.split(",")])
    ap.add_argument("--json", default=None)
    ap.add_argument("--ncu", action="store_true", help="launch each CUDA kernel twice, untimed (a target for ncu)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.int4_cuda_gemv needs a CUDA GPU")
    if args.ncu:
        ncu_targets()
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
