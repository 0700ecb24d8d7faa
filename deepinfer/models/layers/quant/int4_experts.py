"""AWQ / GPTQ routed experts kept int4: the checkpoint's per-expert records stacked into one `QuantizedExperts`.

An AWQ / GPTQ DeepSeek checkpoint quantizes the routed experts like every other linear (per expert and
projection `qweight` / `qzeros` / `scales` (+ GPTQ `g_idx`), which the loader gathers into one `Int4Weight`
record under `experts.E.{gate,up,down}_proj.weight`). When the backend's MoE op runs "int4_awq" / "int4_gptq"
(`op.quantized_expert_schemes()`), the records are repacked here, once, into the contract's layout
(backend/layer_ops.py QuantizedExperts: row-major nibbles along the input dimension, zeros and scales per row
and group): the same 4 bits a weight as stored, one layout for both formats, so one kernel reads them. A GPTQ
act-order g_idx is refused there (backend/native/quant_int4.py `int4_expert_rows`). Otherwise (an op that
does not list the scheme, a layer with a projection left dense) the experts are densified as before.
"""

from __future__ import annotations

import torch

from deepinfer.backend import Int4Weight, QuantizedExperts, int4_expert_rows
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
    group = None
    for slot in slots:
        if isinstance(slot, int):
            for v in parts.values():
                v.append(v[slot])
            continue
        e, gate, up, down = slot
        rows = [int4_expert_rows(r, f"{prefix}.experts.{e}.{proj}")
                for r, proj in zip((gate, up, down), ("gate", "up", "down"))]
        for (q, z, s), r in zip(rows, (gate, up, down)):
            if group is not None and r.group_size != group:
                raise ModelLoadError(f"{prefix}.experts: int4 records mix group sizes {group} and {r.group_size}")
            group = r.group_size
        (qg, zg, sg), (qu, zu, su), (qd, zd, sd) = rows
        parts["w13"].append(torch.cat([qg, qu]))
        parts["w13_zeros"].append(torch.cat([zg, zu]))
        parts["w13_scale"].append(torch.cat([sg, su]))
        parts["w2"].append(qd)
        parts["w2_zeros"].append(zd)
        parts["w2_scale"].append(sd)
    st = {k: torch.stack(v).contiguous() for k, v in parts.items()}
    for k in ("w13_scale", "w2_scale"):
        if st[k].dtype not in (torch.float16, torch.float32):
            st[k] = st[k].float()
    return QuantizedExperts(scheme, st["w13"], st["w13_scale"], st["w2"], st["w2_scale"], st["w13_zeros"],
                            st["w2_zeros"], group)
