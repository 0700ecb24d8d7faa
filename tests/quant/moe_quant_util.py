"""Random quantized routed experts for the quantized-MoE tests, and their independently dequantized dense twin."""

from __future__ import annotations

import torch

from deepinfer.backend import QuantizedExperts, dequant_fp4, dequant_fp8_block, quantize_fp4, quantize_weight_fp8_block

E, D = 4, 64


def make_experts(scheme: str, inter: int, seed: int = 0, device="cpu", num_experts: int = E, hidden: int = D):
    """(QuantizedExperts, dense w13 [E, 2I, D] fp32, dense w2 [E, D, I] fp32): the dense ones dequantized here
    projection by projection, not through the code under test."""
    g = torch.Generator().manual_seed(seed)
    rec = {"w13": [], "w13_scale": [], "w2": [], "w2_scale": []}
    d13, d2 = [], []
    quant = quantize_weight_fp8_block if scheme == "fp8_block" else quantize_fp4
    deq = dequant_fp8_block if scheme == "fp8_block" else dequant_fp4
    for _ in range(num_experts):
        gate = torch.randn(inter, hidden, generator=g) / hidden**0.5
        up = torch.randn(inter, hidden, generator=g) / hidden**0.5
        down = torch.randn(hidden, inter, generator=g) / inter**0.5
        (qg, sg), (qu, su), (qd, sd) = quant(gate), quant(up), quant(down)
        rec["w13"].append(torch.cat([qg, qu]))
        rec["w13_scale"].append(torch.cat([sg, su]))
        rec["w2"].append(qd)
        rec["w2_scale"].append(sd)
        d13.append(torch.cat([deq(qg, sg), deq(qu, su)]))
        d2.append(deq(qd, sd))
    t = {k: torch.stack(v).to(device) for k, v in rec.items()}
    q = QuantizedExperts(scheme, t["w13"], t["w13_scale"], t["w2"], t["w2_scale"])
    return q, torch.stack(d13).float().to(device), torch.stack(d2).float().to(device)


def routing(t: int, k: int = 2, seed: int = 1, drop: bool = False, device="cpu", num_experts: int = E):
    """(weights [t, k] fp32, ids [t, k] int64); drop: some pairs -1 (another rank's experts)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)]) if t else torch.zeros((0, k),
                                                                                                   dtype=torch.long)
    if drop:
        ids[torch.rand(t, k, generator=g) < 0.3] = -1
    return (torch.rand(t, k, generator=g) + 0.1).to(device), ids.to(device)
