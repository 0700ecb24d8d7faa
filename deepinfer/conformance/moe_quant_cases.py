"""Conformance cases of the MoE op with routed experts kept quantized (`MoEOp.load_quantized_experts`): the
QuantizedExperts layouts (fp8 128x128 blocks, V4's fp4 with e8m0 scales, int4 AWQ / GPTQ with zero points, and GPTQ
act-order's per-channel groups, `w13_g_idx`) against the native op, which dequantizes each expert for its turn.

A backend whose MoE op does not list a case's scheme in `quantized_expert_schemes()` (nor `INT4_ACT_ORDER` for the
act-order case) is reported unsupported for it: the model densifies such experts for that op, which the dense
`moe` cases check. The weights are random bytes in the stored layout (not quantized from floats): the layout and
its arithmetic are what is checked, not a quantizer.
"""

from __future__ import annotations

import math

import torch

from deepinfer.backend import INT4_ACT_ORDER, MoESpec, QuantizedExperts, RouterSpec
from deepinfer.conformance.cases_base import Case
from deepinfer.conformance.cases_base import randn as _randn
from deepinfer.errors import UnsupportedOpError

SCHEMES = ("fp8_block", "fp4", "int4_awq", "int4_gptq act-order")
FIELDS = ("w13", "w13_scale", "w2", "w2_scale", "w13_zeros", "w2_zeros", "w13_g_idx")


def _experts(g: torch.Generator, scheme: str, e: int, d: int, inter: int, group: int) -> dict[str, torch.Tensor]:
    """QuantizedExperts' tensors (FIELDS; None where the scheme has none), random in the stored layout, scaled so
    that a weight is ~1 / sqrt(fan-in) (the outputs O(1), so the dtype's tolerance is a real bound)."""
    out: dict[str, torch.Tensor | None] = dict.fromkeys(FIELDS)

    def scales(*shape: int, fan_in: int, typical: float) -> torch.Tensor:  # weight ~ typical stored value x scale
        return (torch.rand(*shape, generator=g) * 0.5 + 0.5) / (typical * fan_in**0.5)

    if scheme == "fp8_block":
        out["w13"] = _randn(g, e, 2 * inter, d, scale=64.0).clamp(-448, 448).to(torch.float8_e4m3fn)
        out["w2"] = _randn(g, e, d, inter, scale=64.0).clamp(-448, 448).to(torch.float8_e4m3fn)
        ci, cd = -(-inter // 128), -(-d // 128)  # 128x128 blocks
        out["w13_scale"] = scales(e, 2 * ci, cd, fan_in=d, typical=64.0)
        out["w2_scale"] = scales(e, cd, ci, fan_in=inter, typical=64.0)
    elif scheme == "fp4":  # e2m1 bytes (magnitudes 0..6), e8m0 scale bytes 2^(b - 127) within 2x of the target
        out["w13"] = torch.randint(0, 256, (e, 2 * inter, d // 2), generator=g, dtype=torch.uint8)
        out["w2"] = torch.randint(0, 256, (e, d, inter // 2), generator=g, dtype=torch.uint8)
        for name, shape, fan_in in (("w13_scale", (e, 2 * inter, d // 32), d), ("w2_scale", (e, d, inter // 32), inter)):
            b = 127 + round(math.log2(0.4 / fan_in**0.5))
            out[name] = torch.randint(b - 1, b + 2, shape, generator=g, dtype=torch.uint8)
    else:  # int4: nibbles, zero points 0..15, fp16 scales; act-order: each expert's channels in its own groups
        out["w13"] = torch.randint(0, 256, (e, 2 * inter, d // 2), generator=g, dtype=torch.uint8)
        out["w2"] = torch.randint(0, 256, (e, d, inter // 2), generator=g, dtype=torch.uint8)
        out["w13_zeros"] = torch.randint(0, 16, (e, 2 * inter, d // group), generator=g, dtype=torch.uint8)
        out["w2_zeros"] = torch.randint(0, 16, (e, d, inter // group), generator=g, dtype=torch.uint8)
        out["w13_scale"] = scales(e, 2 * inter, d // group, fan_in=d, typical=6.0).half()
        out["w2_scale"] = scales(e, d, inter // group, fan_in=inter, typical=6.0).half()
        if scheme.endswith("act-order"):
            out["w13_g_idx"] = torch.stack([torch.argsort(torch.randperm(d, generator=g)) // group
                                            for _ in range(e)]).to(torch.int32)
    return out


def moe_quant_cases(t: int, d: int, inter: int, router: RouterSpec, group: int) -> list[Case]:
    """One case a scheme (SCHEMES): T tokens through `experts` with given routing (-1 ids none)."""
    spec = MoESpec(router=router, hidden_size=d, intermediate_size=inter)
    cases = []
    for label in SCHEMES:
        scheme = label.split()[0]

        def make(g, dt, label=label):
            e, k = router.num_experts, router.top_k
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            inputs = {"x": _randn(g, t, d, dtype=dt), "weights": torch.rand(t, k, generator=g) + 0.1, "ids": ids}
            inputs.update(_experts(g, label, e, d, inter, group))
            return inputs

        def run(o, i, scheme=scheme, label=label):
            op = o.make_moe(spec)
            takes = op.quantized_expert_schemes()
            act_order = i["w13_g_idx"] is not None
            if scheme not in takes or (act_order and INT4_ACT_ORDER not in takes):
                raise UnsupportedOpError(f"the MoE op does not list {INT4_ACT_ORDER if act_order else scheme!r} in "
                                         "quantized_expert_schemes() (the model densifies such experts for it)")
            op.load_quantized_experts(QuantizedExperts(scheme, *(i[f] for f in FIELDS[:6]),
                                                       group_size=group, w13_g_idx=i["w13_g_idx"]))
            return (op.experts(i["x"], i["weights"], i["ids"]),)

        cases.append(Case("moe", f"quantized experts {label} T={t} D={d} I={inter} E={router.num_experts} "
                                 f"k={router.top_k}" + (f" group {group}" if scheme.startswith("int4") else ""),
                          make, run, kind="layer", spec=spec))
    return cases
