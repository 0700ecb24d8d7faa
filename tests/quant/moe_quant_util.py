"""Random quantized routed experts for the quantized-MoE tests, and their independently dequantized dense twin."""

from __future__ import annotations

import torch

from deepinfer.backend import (
    Int4Weight,
    QuantizedExperts,
    dequant_fp4,
    dequant_fp8_block,
    quantize_fp4,
    quantize_weight_fp8_block,
)

E, D = 4, 64


def _int4_projection(w: torch.Tensor, method: str, group: int, perm: torch.Tensor | None = None):
    """(Int4Weight in the checkpoint's packing, its dense fp32 [out, in]) for one projection: quantized and packed
    by the checkpoint writer's helpers (AWQ / GPTQ v1 layouts), dequantized here from the unpacked values.
    perm (GPTQ only): act-order, the input channels quantized G at a time in this order (channel perm[i] in group
    i // G, as GPTQ's desc_act assigns them), g_idx the group of each channel in the stored order."""
    from deepinfer.checkpoints.awq_writer import pack_awq_cols, pack_gptq, quantize_int4

    k = w.shape[1]
    inv = torch.argsort(perm) if perm is not None else torch.arange(k)
    q, z, s = quantize_int4(w[:, perm] if perm is not None else w, group)  # q [K, N] (quantized order), z / s [G, N]
    q = q[inv]  # back to the stored channel order: channel c was quantized at position inv[c]
    rows = inv // group  # each stored channel's group
    if method == "awq":
        rec = Int4Weight("awq", pack_awq_cols(q), pack_awq_cols(z), s, group_size=group)
    else:
        qw, qz = pack_gptq(q, z)
        rec = Int4Weight("gptq", qw, qz, s, rows.to(torch.int32), group, 1)
    dense = ((q.float() - z.float()[rows]) * s.float()[rows]).t().contiguous()
    return rec, dense


def make_int4_experts(scheme: str, inter: int, seed: int = 0, device="cpu", num_experts: int = E, hidden: int = D,
                      group: int = 32, act_order: bool = False):
    """As make_experts for "int4_awq" / "int4_gptq": the experts' records repacked by the engine's loader code
    (stack_int4_experts), the dense twin from the writer's unpacked values. act_order (GPTQ): every expert's
    projections quantized in a random channel order of their own (one for gate and up, which share their inputs;
    expert 0's down projection left in order, so the stack mixes both kinds)."""
    from deepinfer.models.layers.quant.int4_experts import stack_int4_experts

    g = torch.Generator().manual_seed(seed)
    slots, d13, d2 = [], [], []
    for e in range(num_experts):
        mats = [torch.randn(inter, hidden, generator=g) / hidden**0.5, torch.randn(inter, hidden, generator=g) /
                hidden**0.5, torch.randn(hidden, inter, generator=g) / inter**0.5]
        perms = [None, None, None]
        if act_order:
            p_in = torch.randperm(hidden, generator=g)
            perms = [p_in, p_in, torch.randperm(inter, generator=g) if e else None]
        (rg, dg), (ru, du), (rd, dd) = (_int4_projection(m, scheme.removeprefix("int4_"), group, p)
                                        for m, p in zip(mats, perms))
        slots.append((e, rg, ru, rd))
        d13.append(torch.cat([dg, du]))
        d2.append(dd)
    q = stack_int4_experts(scheme, "test", slots)
    q = type(q)(q.scheme, *(getattr(q, f).to(device) for f in ("w13", "w13_scale", "w2", "w2_scale", "w13_zeros",
                                                              "w2_zeros")), q.group_size,
                q.w13_g_idx.to(device) if q.w13_g_idx is not None else None)
    return q, torch.stack(d13).to(device), torch.stack(d2).to(device)


def make_experts(scheme: str, inter: int, seed: int = 0, device="cpu", num_experts: int = E, hidden: int = D):
    """(QuantizedExperts, dense w13 [E, 2I, D] fp32, dense w2 [E, D, I] fp32): the dense ones dequantized here
    projection by projection, not through the code under test."""
    if scheme.startswith("int4_"):  # the largest group that divides both K (hidden for w13, inter for w2)
        group = next(gs for gs in (128, 64, 32) if hidden % gs == 0 and inter % gs == 0)
        return make_int4_experts(scheme, inter, seed, device, num_experts, hidden, group)
    g = torch.Generator().manual_seed(seed)
    rec = {"w13": [], "w13_scale": [], "w2": [], "w2_scale": []}
    d13, d2 = [], []
    fp8 = scheme in ("fp8_block", "fp8_w8a8")  # one stored layout
    quant = quantize_weight_fp8_block if fp8 else quantize_fp4
    deq = dequant_fp8_block if fp8 else dequant_fp4
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
