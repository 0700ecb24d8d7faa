"""The conformance cases: one list per op, at "tiny" (CI, Triton interpreter) or "real" (GPU) shapes.

This file holds the small ops, routing, linear methods and collectives; layer_cases.py the
whole-layer ops (MLA, MoE, V4 attention); bitmask_cases.py the sampling op (the grammar bitmask); runtime_cases.py
the runtime op (decode rows' metadata); cases_base.py what a case is.
"""

from __future__ import annotations

import torch

from deepinfer.backend import Backend, MLASpec, RouterSpec, SingleProcessCommunicator
from deepinfer.backend.native.rope import rope_cos_sin_cache
from deepinfer.backend.native.v4_rope import v4_cos_sin, v4_inv_freq
from deepinfer.conformance.bitmask_cases import bitmask_cases
from deepinfer.conformance.runtime_cases import runtime_cases
from deepinfer.conformance.cases_base import FP32, Case, router_inputs, router_specs
from deepinfer.conformance.cases_base import randn as _randn
from deepinfer.conformance.layer_cases import (
    mla_cases,
    mla_latent_cases,
    mla_prolog_cases,
    moe_cases,
    moe_shared_cases,
    v4_attention_cases,
)
from deepinfer.conformance.moe_quant_cases import moe_quant_cases

__all__ = ["Case", "cases_for", "router_specs"]


# ------------------------------------------------------------------ small ops


def _norm_cases(d: int, t: int) -> list[Case]:
    def make(g, dt):
        return {"x": _randn(g, t, d, dtype=dt, scale=2.0), "r": _randn(g, t, d, dtype=dt),
                "w": _randn(g, d, dtype=dt, scale=0.5) + 1}

    return [
        Case("rms_norm", f"T={t} D={d}", make, lambda o, i: (o.rms_norm(i["x"], i["w"], 1e-6),)),
        Case("add_rms_norm", f"T={t} D={d}", make, lambda o, i: o.add_rms_norm(i["x"], i["r"], i["w"], 1e-6)),
    ]


def _fp8_act_out(act, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """An Fp8Act as the runner compares it: `values` (the op's compute-dtype output: act.x, or the plain op's where
    it was not kept), compared with the reference's within the dtype's tolerance, and the number of e4m3 values,
    row-major scales and column-major scales that differ from the torch reference quantization of those same values
    (int64: compared exactly, so 0 for both). Why not q itself: the values may differ from the reference's by a
    rounding (the Triton and torch norms round the last bit differently at times), and their e4m3 then by a whole
    step; the contract is that q / s are the exact quantization of the values the op returns."""
    from deepinfer.backend import fp8_act_reference

    ref = fp8_act_reference(values)
    bad_q = (act.q.view(torch.uint8) != ref.q.view(torch.uint8)).sum()
    return values, bad_q, (act.s != ref.s).sum(), (act.s_cm != ref.s).sum()


def _fp8_act_cases(t: int, d: int, i_dim: int) -> list[Case]:
    """rms_norm_fp8 (with and without the residual) and silu_and_mul_fp8 (values kept or not): the backend's one
    pass against the contract's reference (the norm / SiLU-and-mul op, then the torch quantization)."""
    def make(g, dt):
        return {"x": _randn(g, t, d, dtype=dt, scale=2.0), "r": _randn(g, t, d, dtype=dt),
                "w": _randn(g, d, dtype=dt, scale=0.5) + 1, "h": _randn(g, t, 2 * i_dim, dtype=dt, scale=2)}

    def norm(o, i, res):
        act, total = o.rms_norm_fp8(i["x"], i["r"] if res else None, i["w"], 1e-6)
        return _fp8_act_out(act, act.x) + ((total,) if res else ())

    def silu(o, i, keep):
        act = o.silu_and_mul_fp8(i["h"], keep)
        return _fp8_act_out(act, act.x if keep else o.silu_and_mul(i["h"]))

    return [Case("rms_norm_fp8", f"T={t} D={d}", make, lambda o, i: norm(o, i, False)),
            Case("rms_norm_fp8", f"T={t} D={d} + residual", make, lambda o, i: norm(o, i, True)),
            *(Case("silu_and_mul_fp8", f"T={t} I={i_dim}{' values kept' if keep else ''}", make,
                   lambda o, i, keep=keep: silu(o, i, keep)) for keep in (False, True))]


def _rope_cases(t: int, hq: int, r: int) -> list[Case]:
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    cases = []
    for interleaved in (True, False):
        def make(g, dt):
            return {"pos": torch.randint(0, 1024, (t,), generator=g), "q": _randn(g, t, hq, r, dtype=dt),
                    "k": _randn(g, t, 1, r, dtype=dt), "cache": rope_cos_sin_cache(r, 1024, 10000.0, yarn)}

        def run(o, i, inter=interleaved):
            return o.rotary_embedding(i["pos"], i["q"], i["k"], i["cache"], inter)

        cases.append(Case("rotary_embedding", f"T={t} Hq={hq} R={r} {'interleaved' if interleaved else 'neox'} yarn",
                          make, run))
    return cases


def _silu_cases(t: int, i_dim: int, limit: float) -> list[Case]:
    def make(g, dt):
        return {"x": _randn(g, t, 2 * i_dim, dtype=dt, scale=2)}

    return [Case("silu_and_mul", f"T={t} I={i_dim}", make, lambda o, i: (o.silu_and_mul(i["x"]),)),
            Case("silu_and_mul", f"T={t} I={i_dim} clamped limit={limit} (V4)", make,
                 lambda o, i: (o.silu_and_mul(i["x"], limit),), options=(("limit", limit),))]


def _v4_norm_cases(t: int, h: int, d: int) -> list[Case]:
    """V4's RMSNorm: an fp32 weight over [T, D]; unweighted per head over [T, H, D]."""
    def make(g, dt):
        return {"x": _randn(g, t, d, dtype=dt, scale=2.0), "w": _randn(g, d, scale=0.5) + 1,
                "heads": _randn(g, t, h, d, dtype=dt, scale=2.0)}

    return [Case("v4_rms_norm", f"T={t} D={d} fp32 weight", make, lambda o, i: (o.v4_rms_norm(i["x"], i["w"], 1e-6),)),
            Case("v4_rms_norm", f"T={t} H={h} D={d} unweighted", make,
                 lambda o, i: (o.v4_rms_norm(i["heads"], None, 1e-6),))]


def _v4_rope_cases(t: int, h: int, d: int, r: int) -> list[Case]:
    """V4's rotary embedding on the trailing r channels: q-like [T, H, D], kv-like [T, D], the inverse."""
    yarn = v4_inv_freq(r, 10000.0, "yarn", 16.0, 64, 32.0, 1.0)

    def make(g, dt):
        cos, sin = v4_cos_sin(torch.randint(0, 4096, (t,), generator=g), yarn)
        return {"q": _randn(g, t, h, d, dtype=dt), "kv": _randn(g, t, d, dtype=dt), "cos": cos.to(dt), "sin": sin.to(dt)}

    return [Case("v4_rotary_embedding", f"T={t} H={h} D={d} R={r} yarn", make,
                 lambda o, i: (o.v4_rotary_embedding(i["q"], i["cos"], i["sin"]),)),
            Case("v4_rotary_embedding", f"T={t} D={d} R={r} one head", make,
                 lambda o, i: (o.v4_rotary_embedding(i["kv"], i["cos"], i["sin"]),)),
            Case("v4_rotary_embedding", f"T={t} H={h} D={d} R={r} inverse (-sin)", make,
                 lambda o, i: (o.v4_rotary_embedding(i["q"], i["cos"], -i["sin"]),))]


def _kv_write_cases(blocks: int, block_size: int, width: int, t: int) -> list[Case]:
    def make(g, dt):
        slots = torch.randperm(blocks * block_size, generator=g)[:t]
        slots[t // 2] = -1  # a padding row
        return {"cache": _randn(g, blocks, block_size, width, dtype=dt), "slots": slots,
                "vals": _randn(g, t, width, dtype=dt)}

    def run(o, i):
        cache = i["cache"].clone()
        o.kv_cache_write(cache, i["slots"], i["vals"])
        return (cache,)

    return [Case("kv_cache_write", f"T={t} blocks={blocks}x{block_size} entry={width}", make, run, compare="exact")]


# ------------------------------------------------------------------ routing



# ------------------------------------------------------------------ routing


def _route_cases(t: int, real: bool) -> list[Case]:
    cases = []
    for name, spec in router_specs(real).items():
        def run(o, i, s=spec):
            return o.route(i["logits"], s, i["bias"], i["tokens"], i["tid2eid"])

        cases.append(Case("route", f"{name} E={spec.num_experts} k={spec.top_k} T={t}",
                          lambda g, dt, s=spec: router_inputs(g, s, t), run, compare="route", dtypes=FP32,
                          spec=spec))
    return cases


# ------------------------------------------------------------------ linear


def _linear_cases(t: int, shapes: list[tuple[int, int]]) -> list[Case]:
    cases = []
    for out_f, in_f in shapes:
        def make_none(g, dt, o_=out_f, i_=in_f):
            return {"x": _randn(g, t, i_, dtype=dt), "w": _randn(g, o_, i_, scale=i_**-0.5), "b": _randn(g, o_)}

        def make_fp8(g, dt, o_=out_f, i_=in_f):
            w8 = (torch.randn(o_, i_, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            s = torch.rand(-(-o_ // 128), -(-i_ // 128), generator=g) * (i_**-0.5) / 100 + 1e-4
            return {"x": _randn(g, t, i_, dtype=dt), "w": w8, "s": s, "b": None}

        def run(o, i, scheme):
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(i["w"].clone(), requires_grad=False)
            layer.bias = None if i["b"] is None else torch.nn.Parameter(i["b"].clone(), requires_grad=False)
            if "s" in i:
                layer.weight_scale_inv = torch.nn.Parameter(i["s"].clone(), requires_grad=False)
            method = o.linear_method(scheme)
            method.process_weights(layer, i["x"].dtype)
            return (method.apply(layer, i["x"]),)

        cases.append(Case("linear:none", f"T={t} {in_f}->{out_f} bias", make_none,
                          lambda o, i: run(o, i, "none"), kind="layer"))
        cases.append(Case("linear:fp8_block", f"T={t} {in_f}->{out_f} e4m3 128x128", make_fp8,
                          lambda o, i: run(o, i, "fp8_block"), kind="layer"))
        # W8A8: the reference quantizes x per token per 128 channels as the kernel does (like with like)
        cases.append(Case("linear:fp8_w8a8", f"T={t} {in_f}->{out_f} e4m3 128x128, x per token per 128", make_fp8,
                          lambda o, i: run(o, i, "fp8_w8a8"), kind="layer"))
    return cases


def _int4_cases(t: int, shapes: list[tuple[int, int]]) -> list[Case]:
    """int4 weight-only, AWQ and GPTQ packing, random packed words (K % 128 == 0, N % 8 == 0)."""
    from deepinfer.backend import Int4Weight

    cases = []
    for out_f, in_f in shapes:
        def make(g, dt, o_=out_f, i_=in_f):
            words = lambda r, c: torch.randint(-2**31, 2**31 - 1, (r, c), generator=g, dtype=torch.int64  # noqa: E731
                                               ).to(torch.int32)
            scales = (torch.rand(i_ // 128, o_, generator=g) * 0.02 / (i_ ** 0.5) + 1e-4).half()
            return {"x": _randn(g, t, i_, dtype=dt), "awq": (words(i_, o_ // 8), words(i_ // 128, o_ // 8), scales),
                    "gptq": (words(i_ // 8, o_), words(i_ // 128, o_ // 8), scales,
                             torch.arange(i_).div(128, rounding_mode="floor").to(torch.int32)),
                    # act-order: rows of a group scattered over K (a permuted g_idx)
                    "gptq_act_order": (words(i_ // 8, o_), words(i_ // 128, o_ // 8), scales,
                                       torch.randperm(i_, generator=g).div(128, rounding_mode="floor").to(torch.int32))}

        def run(o, i, key):
            method = "gptq" if key.startswith("gptq") else key
            layer = torch.nn.Module()
            parts = [p.clone() for p in i[key]]
            layer.int4 = Int4Weight(method, *parts[:3], parts[3] if method == "gptq" else None,
                                    zero_offset=1 if method == "gptq" else 0)
            layer.weight = layer.bias = None
            m = o.linear_method(f"int4_{method}")
            m.process_weights(layer, i["x"].dtype)
            return (m.apply(layer, i["x"]),)

        for key, label in (("awq", "awq"), ("gptq", "gptq"), ("gptq_act_order", "gptq")):
            extra = " act-order g_idx" if key == "gptq_act_order" else ""
            cases.append(Case(f"linear:int4_{label}", f"T={t} {in_f}->{out_f} group 128{extra}", make,
                              lambda o, i, k_=key: run(o, i, k_), kind="layer"))
    return cases

def _int8_cases(t: int, shapes: list[tuple[int, int]]) -> list[Case]:
    """int8 W8A8 dynamic (msModelSlim W8A8_DYNAMIC): random int8 weights, per-channel scales [out, 1], a zero
    weight_offset, x quantized per token by the op under test (the reference does the same: like with like)."""
    cases = []
    for out_f, in_f in shapes:
        def make(g, dt, o_=out_f, i_=in_f):
            w = torch.randint(-127, 128, (o_, i_), generator=g, dtype=torch.int32).to(torch.int8)
            s = torch.rand(o_, 1, generator=g) * 0.02 / (i_ ** 0.5) + 1e-4
            b = _randn(g, o_, dtype=dt) * 0.1
            return {"x": _randn(g, t, i_, dtype=dt), "w": w, "s": s, "b": b}

        def run(o, i):
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(i["w"].clone(), requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(i["s"].clone(), requires_grad=False)
            layer.weight_offset = torch.nn.Parameter(torch.zeros_like(i["s"]), requires_grad=False)
            layer.bias = torch.nn.Parameter(i["b"].clone(), requires_grad=False)
            m = o.linear_method("int8_w8a8")
            m.process_weights(layer, i["x"].dtype)
            return (m.apply(layer, i["x"]),)

        cases.append(Case("linear:int8_w8a8", f"T={t} {in_f}->{out_f} int8 per-channel, x int8 per token, bias",
                          make, run, kind="layer"))
    return cases

# ------------------------------------------------------------------ collectives


def _collective_cases(t: int, d: int) -> list[Case]:
    """Each collective of `backend.communicator()` on one rank's tensor, against the native group of one
    (the identity, exactly). A communicator spanning several ranks needs the multi-process suite
    (collectives.py, `deepinfer check --world-size N`); these cases then say so (UnsupportedOpError) instead
    of comparing what cannot be equal."""
    from deepinfer.errors import UnsupportedOpError

    calls = {
        "all_reduce": lambda c, x: c.all_reduce(x),
        "all_gather": lambda c, x: c.all_gather(x, dim=-1),
        "reduce_scatter": lambda c, x: c.reduce_scatter(x, dim=0),
        "all_to_all": lambda c, x: c.all_to_all(x, [x.shape[0]], [x.shape[0]]),
        "broadcast": lambda c, x: c.broadcast(x, src=0),
    }

    def make(g, dt):
        return {"x": _randn(g, t, d, dtype=dt)}

    cases = []
    for name, call in calls.items():
        def run(o, i, call=call):
            # the oracle (NativeOps alone, no Backend) is the group of one the contract defines
            comm = o.communicator() if isinstance(o, Backend) else SingleProcessCommunicator()
            if comm.world_size != 1:
                raise UnsupportedOpError(f"a communicator over {comm.world_size} ranks: run the multi-process "
                                         "suite (deepinfer check --world-size N)")
            return (call(comm, i["x"].clone()),)

        cases.append(Case(name, f"T={t} D={d} one rank", make, run, compare="exact"))
    return cases


# ------------------------------------------------------------------ the lists


def cases_for(shapes: str) -> list[Case]:
    """Every case at "tiny" (tens of rows; CPU CI and TRITON_INTERPRET) or "real" (DeepSeek widths) shapes."""
    if shapes == "tiny":
        mla = MLASpec(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
                      softmax_scale=24**-0.5)
        return [
            *_norm_cases(64, 7),
            *_rope_cases(9, 4, 16),
            *_silu_cases(7, 48, limit=1.5),
            *_fp8_act_cases(7, 200, 72),
            *_v4_norm_cases(7, 3, 64),
            *_v4_rope_cases(9, 4, 32, 16),
            *_kv_write_cases(6, 16, 40, 11),
            *_route_cases(9, real=False),
            *_linear_cases(5, [(48, 64), (200, 136)]),
            *_int4_cases(5, [(48, 256)]),
            *_int8_cases(5, [(48, 64), (200, 136)]),
            *mla_cases(mla, 16, {
                "prefill": ([7], [0]),
                "decode": ([1, 1, 1], [9, 20, 1]),
                "mixed chunked": ([5, 1, 3], [0, 12, 17]),
            }),
            *mla_latent_cases(mla, 16, {"decode": ([1, 1, 1], [9, 20, 1]), "mixed": ([5, 1], [0, 12])}),
            *moe_cases(9, 64, 32, router_specs(real=False), limit=0.5),
            *moe_shared_cases(3, 64, 32, 2, router_specs(real=False)["v2-lite softmax greedy"], from_hidden=True),
            *moe_shared_cases(5, 64, 32, 2, router_specs(real=False)["v3 sigmoid noaux_tc"], from_hidden=True),
            *moe_shared_cases(20, 64, 32, 2, router_specs(real=False)["v2-lite softmax greedy"]),
            *moe_quant_cases(5, 64, 64, RouterSpec(8, 2, "softmax", "greedy"), group=32),
            *v4_attention_cases("tiny"),
            *bitmask_cases("tiny"),
            *runtime_cases("tiny"),
            *_collective_cases(5, 32),
        ]
    if shapes == "real":
        mla = MLASpec(num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                      softmax_scale=192**-0.5)
        # V2-Lite expert widths (64 x 2048 x 1408); V3's 256 x 7168 x 2048 experts would not fit a quick check
        routers = {
            "v2-lite softmax greedy": router_specs(real=True)["v2-lite softmax greedy"],
            "v3 sigmoid noaux_tc": RouterSpec(64, 6, "sigmoid", "noaux_tc", n_group=8, topk_group=4,
                                              norm_topk_prob=True, routed_scaling_factor=2.5),
        }
        return [
            *_norm_cases(2048, 64),
            *_norm_cases(7168, 8),
            *_rope_cases(64, 128, 64),
            *_silu_cases(64, 1408, limit=10.0),
            *_fp8_act_cases(256, 2048, 1408),
            *_v4_norm_cases(64, 64, 512),
            *_v4_rope_cases(64, 64, 512, 64),
            *_kv_write_cases(64, 16, 576, 200),
            *_route_cases(128, real=True),
            *_linear_cases(32, [(3072, 2048), (2112, 7168), (576, 2048)]),
            *_int4_cases(32, [(3072, 2048), (2048, 2048)]),
            *_int4_cases(1, [(3072, 2048)]),  # one token: nvidia's CUDA C++ GEMV (quant/int4_cuda.py)
            *_int8_cases(32, [(3072, 2048), (2112, 7168)]),
            *mla_cases(mla, 16, {
                "prefill": ([256], [0]),
                "decode": ([1] * 16, [int(x) for x in torch.linspace(1, 1000, 16)]),
                "mixed chunked": ([128, 1, 1, 64], [0, 300, 77, 512]),
            }),
            *mla_latent_cases(mla, 64, {"decode": ([1] * 16, [int(x) for x in torch.linspace(1, 1500, 16)]),
                                         "mixed": ([64, 1, 1], [0, 300, 1000])}),
            # the layer from the hidden states at DeepSeek-V3's widths (hidden 7168, q_lora 1536): where Ascend's
            # npu_mla_prolog_v3 runs (decode, interleaved RoPE); every other backend composes the projections
            *mla_prolog_cases(mla, 7168, 1536, 16, {"decode": ([1] * 4, [5, 40, 100, 7], True),
                                                     "mixed": ([16, 1], [0, 30], True)}),
            *moe_cases(32, 2048, 1408, routers, limit=10.0),
            # small decode batches (NVIDIA: direct mode; shared experts folded in at T=1, dense at T=32);
            # 16 experts of V2-Lite width keep the random weights quick to draw
            *moe_cases(4, 2048, 1408, {"v3 sigmoid noaux_tc": RouterSpec(16, 6, "sigmoid", "noaux_tc", n_group=4,
                                                                          topk_group=2, norm_topk_prob=True,
                                                                          routed_scaling_factor=2.5)}, limit=None),
            *moe_shared_cases(1, 2048, 1408, 2, RouterSpec(16, 6, "softmax", "greedy"), from_hidden=True),
            *moe_shared_cases(32, 2048, 1408, 2, RouterSpec(16, 6, "softmax", "greedy")),
            *moe_quant_cases(1, 2048, 1408, RouterSpec(16, 6, "softmax", "greedy"), group=128),
            *moe_quant_cases(32, 2048, 1408, RouterSpec(16, 6, "softmax", "greedy"), group=128),
            *v4_attention_cases("real"),
            *bitmask_cases("real"),
            *runtime_cases("real"),
            *_collective_cases(64, 2048),
        ]
    raise ValueError(f"unknown conformance shapes {shapes!r} (choose 'tiny' or 'real')")
