"""AWQ / GPTQ routed experts kept int4: the checkpoint's per-expert records stacked into one `QuantizedExperts`.

An AWQ / GPTQ DeepSeek checkpoint quantizes the routed experts like every other linear (per expert and
projection `qweight` / `qzeros` / `scales` (+ GPTQ `g_idx`), which the loader gathers into one `Int4Weight`
record under `experts.E.{gate,up,down}_proj.weight`). When the backend's MoE op runs "int4_awq" / "int4_gptq"
(`op.quantized_expert_schemes()`), the records are repacked here, once, into the contract's layout
(backend/quantized_experts.py QuantizedExperts: row-major nibbles along the input dimension, zeros and scales per row
and group): the same 4 bits a weight as stored, one layout for both formats, so one kernel reads them.
Otherwise (an op that does not list the scheme, a layer with a projection left dense) the experts are densified
as before.

GPTQ act-order (desc_act: g_idx a permutation of k // G): the down projection's input channels are sorted by
group here (`act_order_permutation`), so its groups are contiguous again, and the gate and up rows, whose outputs
are those channels, are put in the same order: silu(gate) * up then comes out sorted as the down projection reads
it, exactly, at no cost a token. The gate and up projections' own g_idx (one for both: GPTQ quantizes both from the
same inputs, so their orders agree; else refused) stays as QuantizedExperts.w13_g_idx, which the kernels read per
input channel.
"""

from __future__ import annotations

import torch

from deepinfer.backend import Int4Weight, QuantizedExperts, act_order_permutation, int4_expert_values, pack_int4_rows
from deepinfer.errors import ModelLoadError


def int4_scheme_of(weights: list) -> str | None:
    """"int4_awq" / "int4_gptq" when every loaded expert weight is an int4 record of one method and group size,
    else None (dense weights, or a mix: the layer is densified)."""
    if not weights or not all(isinstance(w, Int4Weight) for w in weights):
        return None
    methods = {(w.method, w.group_size, w.zero_offset) for w in weights}
    if len(methods) != 1:
        return None
    return weights[0].scheme


def stack_int4_experts(scheme: str, prefix: str, slots: list[tuple[int, Int4Weight, Int4Weight, Int4Weight] | int]
                       ) -> QuantizedExperts:
    """slots: per physical slot either (expert, gate, up, down records) or the index of an earlier slot holding
    the same expert (a second replica on this rank). Gate rows first, then up rows, as the dense w13."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("w13", "w13_scale", "w13_zeros", "w2", "w2_scale",
                                                               "w2_zeros")}
    g_idx: list[torch.Tensor | None] = []  # per slot: the gate / up projections' act-order groups, or None
    group = None
    for slot in slots:
        if isinstance(slot, int):
            for v in parts.values():
                v.append(v[slot])
            g_idx.append(g_idx[slot])
            continue
        e, gate, up, down = slot
        for r in (gate, up, down):
            if group is not None and r.group_size != group:
                raise ModelLoadError(f"{prefix}.experts: int4 records mix group sizes {group} and {r.group_size}")
            group = r.group_size
        name = f"{prefix}.experts.{e}"
        w13, w2, gi = _expert_rows(name, *(int4_expert_values(r) for r in (gate, up, down)), group)
        for key, t in zip(("w13", "w13_zeros", "w13_scale", "w2", "w2_zeros", "w2_scale"), (*w13, *w2)):
            parts[key].append(t)
        g_idx.append(gi)
    st = {k: torch.stack(v).contiguous() for k, v in parts.items()}
    for k in ("w13_scale", "w2_scale"):
        if st[k].dtype not in (torch.float16, torch.float32):
            st[k] = st[k].float()
    w13_g_idx = None
    if any(gi is not None for gi in g_idx):  # (experts without act-order: their groups k // G)
        hidden = st["w13"].shape[2] * 2
        trivial = (torch.arange(hidden) // group).to(torch.int32)
        w13_g_idx = torch.stack([trivial if gi is None else gi.cpu() for gi in g_idx]).contiguous().to(
            st["w13"].device)
    return QuantizedExperts(scheme, st["w13"], st["w13_scale"], st["w2"], st["w2_scale"], st["w13_zeros"],
                            st["w2_zeros"], group, w13_g_idx)


def _expert_rows(name: str, gate, up, down, group: int):
    """One expert's three projections (int4_expert_values each) -> ((w13 packed, zeros, scales), (w2 packed, zeros,
    scales), the gate / up g_idx or None), act-order resolved as the module docstring says."""
    (qg, zg, sg, gg), (qu, zu, su, gu), (qd, zd, sd, gd) = gate, up, down
    if (gg is None) != (gu is None) or (gg is not None and not torch.equal(gg, gu)):
        raise ModelLoadError(f"{name}: the gate_proj and up_proj g_idx differ (GPTQ act-order quantizes both from the "
                             "same inputs, in one order); int4 routed experts need one order for both")
    if gd is not None:  # down's inputs sorted by group; gate / up rows (down's inputs) in that order
        perm = act_order_permutation(gd, group, f"{name}.down_proj").to(qd.device)
        qd = qd[:, perm]
        qg, zg, sg = qg[perm], zg[perm], sg[perm]
        qu, zu, su = qu[perm], zu[perm], su[perm]
    w13 = (pack_int4_rows(torch.cat([qg, qu])), torch.cat([zg, zu]).contiguous(), torch.cat([sg, su]).contiguous())
    return w13, (pack_int4_rows(qd), zd, sd), gg
