"""The conformance cases: one list per op, at "tiny" (CI, Triton interpreter) or "real" (GPU) shapes.

A case builds its inputs on the CPU from a seeded generator (so every device
sees the same numbers), and runs one op through any object with the Backend
op methods. The runner moves inputs to the backend's device and compares
the backend with `NativeOps`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepinfer.core.backend import MLASpec, MoESpec, RouterSpec
from deepinfer.core.forward_batch import ForwardBatch
from deepinfer.core.native.rope import rope_cos_sin_cache

Inputs = dict[str, Any]
FP32 = (torch.float32,)


@dataclass(frozen=True)
class Case:
    op: str  # OP_NAMES entry
    name: str
    make: Callable[[torch.Generator, torch.dtype], Inputs]  # CPU tensors
    run: Callable[[Any, Inputs], tuple[torch.Tensor, ...]]  # (backend-like ops, inputs) -> outputs
    compare: str = "close"  # close | exact | route
    kind: str = "elementwise"  # elementwise | layer (looser low-precision tolerances)
    dtypes: tuple[torch.dtype, ...] | None = None  # fixed dtypes (route: fp32 logits); None = the run's


def _randn(g: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ------------------------------------------------------------------ small ops


def _norm_cases(d: int, t: int) -> list[Case]:
    def make(g, dt):
        return {"x": _randn(g, t, d, dtype=dt, scale=2.0), "r": _randn(g, t, d, dtype=dt),
                "w": _randn(g, d, dtype=dt, scale=0.5) + 1}

    return [
        Case("rms_norm", f"T={t} D={d}", make, lambda o, i: (o.rms_norm(i["x"], i["w"], 1e-6),)),
        Case("add_rms_norm", f"T={t} D={d}", make, lambda o, i: o.add_rms_norm(i["x"], i["r"], i["w"], 1e-6)),
    ]


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


def _silu_cases(t: int, i_dim: int) -> list[Case]:
    return [Case("silu_and_mul", f"T={t} I={i_dim}", lambda g, dt: {"x": _randn(g, t, 2 * i_dim, dtype=dt, scale=2)},
                 lambda o, i: (o.silu_and_mul(i["x"]),))]


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


def router_specs(real: bool) -> dict[str, RouterSpec]:
    e2, e3 = (64, 256) if real else (16, 32)
    return {
        "v2-lite softmax greedy": RouterSpec(e2, 6 if real else 4, "softmax", "greedy", routed_scaling_factor=1.0),
        "v2 softmax group_limited_greedy": RouterSpec(e2, 6 if real else 4, "softmax", "group_limited_greedy",
                                                      n_group=8 if real else 4, topk_group=3 if real else 2,
                                                      routed_scaling_factor=16.0),
        "v3 sigmoid noaux_tc": RouterSpec(e3, 8 if real else 4, "sigmoid", "noaux_tc", n_group=8, topk_group=4,
                                          norm_topk_prob=True, routed_scaling_factor=2.5),
        "v4 sqrtsoftplus noaux_tc": RouterSpec(e3, 6 if real else 4, "sqrtsoftplus", "noaux_tc",
                                               norm_topk_prob=True, routed_scaling_factor=1.5),
        "v4 sqrtsoftplus hash": RouterSpec(e3, 6 if real else 4, "sqrtsoftplus", "hash", norm_topk_prob=True,
                                           routed_scaling_factor=1.5),
    }


def _router_inputs(g: torch.Generator, spec: RouterSpec, t: int, vocab: int = 64) -> Inputs:
    inputs: Inputs = {"logits": _randn(g, t, spec.num_experts, scale=2.0), "bias": None, "tokens": None, "tid2eid": None}
    if spec.topk_method == "noaux_tc":
        inputs["bias"] = _randn(g, spec.num_experts, scale=0.1)
    if spec.topk_method == "hash":
        inputs["tokens"] = torch.randint(0, vocab, (t,), generator=g)
        inputs["tid2eid"] = torch.stack([torch.randperm(spec.num_experts, generator=g)[: spec.top_k]
                                         for _ in range(vocab)])
    return inputs


def _route_cases(t: int, real: bool) -> list[Case]:
    cases = []
    for name, spec in router_specs(real).items():
        def run(o, i, s=spec):
            return o.route(i["logits"], s, i["bias"], i["tokens"], i["tid2eid"])

        cases.append(Case("route", f"{name} E={spec.num_experts} k={spec.top_k} T={t}",
                          lambda g, dt, s=spec: _router_inputs(g, s, t), run, compare="route", dtypes=FP32))
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
    return cases


# ------------------------------------------------------------------ MLA attention


def _mla_batch(query_lens: list[int], context_lens: list[int], block_size: int, num_blocks: int,
               g: torch.Generator, name: str = "mla") -> ForwardBatch:
    """Requests on shuffled blocks; their cached prefixes are whatever the (random) cache holds there."""
    seqs = [q + c for q, c in zip(query_lens, context_lens)]
    need = [-(-s // block_size) for s in seqs]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    rows, start = [], 0
    for n in need:
        rows.append(perm[start : start + n])
        start += n
    width = max(need)
    slots, positions = [], []
    for q, c, row in zip(query_lens, context_lens, rows):
        for p in range(c, c + q):
            slots.append(row[p // block_size] * block_size + p % block_size)
            positions.append(p)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return ForwardBatch(
        input_ids=torch.zeros(sum(query_lens), dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seqs, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables={name: torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)},
        slot_mapping={name: torch.tensor(slots, dtype=torch.long)},
        logits_indices=torch.tensor(qsl[1:], dtype=torch.long) - 1,
        query_lens_cpu=list(query_lens), seq_lens_cpu=seqs, context_lens_cpu=list(context_lens),
        block_size=block_size,
    )


def _lens(values: list[int]) -> str:
    """Short label for a list of lengths: [5,1,3] or 16x[1..1000]."""
    if len(values) <= 4:
        return "[" + ",".join(map(str, values)) + "]"
    return f"{len(values)}x[{min(values)}..{max(values)}]"


def _mla_inputs(spec: MLASpec, block_size: int, qlens: list[int], ctxs: list[int], g, dt) -> tuple[int, int, dict]:
    """(tokens, cache blocks, the batch / kv_b / q inputs) both MLA case families draw first, in this order."""
    t = sum(qlens)
    blocks = sum(-(-(q + c) // block_size) for q, c in zip(qlens, ctxs)) + 2
    return t, blocks, {
        "batch": _mla_batch(qlens, ctxs, block_size, blocks, g),
        "kv_b": _randn(g, spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank,
                       dtype=dt, scale=spec.kv_lora_rank**-0.5),
        "q": _randn(g, t, spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim, dtype=dt),
    }


def _mla_cases(spec: MLASpec, block_size: int, batches: dict[str, tuple[list[int], list[int]]]) -> list[Case]:
    cases = []
    for label, (qlens, ctxs) in batches.items():
        def make(g, dt, qlens=qlens, ctxs=ctxs):
            t, blocks, common = _mla_inputs(spec, block_size, qlens, ctxs, g, dt)
            return {
                **common,
                "kv_c": _randn(g, t, spec.kv_lora_rank, dtype=dt),
                "k_pe": _randn(g, t, spec.qk_rope_head_dim, dtype=dt),
                "cache": _randn(g, blocks, block_size, spec.cache_entry_dim, dtype=dt),
            }

        def run(o, i):
            op = o.make_mla_attention(spec)
            op.load_kv_b_proj(i["kv_b"])
            cache = i["cache"].clone()
            out = op.forward(i["q"], i["kv_c"], i["k_pe"], cache, i["batch"], "mla")
            return out, cache

        desc = f"{label} q={_lens(qlens)} ctx={_lens(ctxs)} H={spec.num_heads} L={spec.kv_lora_rank}"
        cases.append(Case("mla_attention", desc, make, run, kind="layer"))
    return cases


def _mla_latent_cases(spec: MLASpec, block_size: int, batches: dict[str, tuple[list[int], list[int]]]) -> list[Case]:
    """forward_from_latent: kv_a norm + RoPE (q_pe, k_pe) + KV write + attention (one fused kernel on NVIDIA)."""
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    cases = []
    for label, (qlens, ctxs) in batches.items():
        for interleaved in (True, False):
            def make(g, dt, qlens=qlens, ctxs=ctxs):
                t, blocks, common = _mla_inputs(spec, block_size, qlens, ctxs, g, dt)
                return {
                    **common,
                    "kv_a": _randn(g, t, spec.cache_entry_dim, dtype=dt, scale=2.0),
                    "w": _randn(g, spec.kv_lora_rank, dtype=dt, scale=0.5) + 1,
                    "rope": rope_cos_sin_cache(spec.qk_rope_head_dim, 2048, 10000.0, yarn),
                    "cache": _randn(g, blocks, block_size, spec.cache_entry_dim, dtype=dt),
                }

            def run(o, i, inter=interleaved):
                op = o.make_mla_attention(spec)
                op.load_kv_b_proj(i["kv_b"])
                cache = i["cache"].clone()
                b = i["batch"]
                out = op.forward_from_latent(i["q"].clone(), i["kv_a"], i["w"], 1e-6, b.positions, i["rope"], inter,
                                             cache, b, "mla", o)
                return out, cache

            desc = (f"from latent ({'interleaved' if interleaved else 'halves'}) {label} q={_lens(qlens)} "
                    f"ctx={_lens(ctxs)} H={spec.num_heads} L={spec.kv_lora_rank}")
            cases.append(Case("mla_attention", desc, make, run, kind="layer"))
    return cases


# ------------------------------------------------------------------ MoE


def _moe_cases(t: int, d: int, inter: int, routers: dict[str, RouterSpec], limit: float | None) -> list[Case]:
    cases = []
    for name, rspec in routers.items():
        spec = MoESpec(router=rspec, hidden_size=d, intermediate_size=inter,
                       swiglu_limit=limit if name.startswith("v4") else None)

        def make(g, dt, s=spec):
            inputs = _router_inputs(g, s.router, t)
            e = s.router.num_experts
            inputs.update(x=_randn(g, t, d, dtype=dt),
                          w13=_randn(g, e, 2 * inter, d, dtype=dt, scale=d**-0.5),
                          w2=_randn(g, e, d, inter, dtype=dt, scale=inter**-0.5))
            return inputs

        def run(o, i, s=spec):
            op = o.make_moe(s)
            op.load_experts(i["w13"], i["w2"])
            return (op.forward(i["x"], i["logits"], i["bias"], i["tokens"], i["tid2eid"]),)

        lim = f" swiglu_limit={spec.swiglu_limit}" if spec.swiglu_limit is not None else ""
        cases.append(Case("moe", f"{name} T={t} D={d} I={inter} E={rspec.num_experts}{lim}", make, run, kind="layer"))
    return cases


def _moe_shared_cases(t: int, d: int, inter: int, n_shared: int, rspec: RouterSpec,
                      from_hidden: bool = False) -> list[Case]:
    """Routed + shared experts through MoEOp.fuse_shared_experts / forward(shared_experts=...): an op may run
    the shared MLP as extra experts (NVIDIA at small T) or call it; either must equal native routed + MLP.
    from_hidden: through forward_hidden with the fp32 router gate (NVIDIA fuses the gate GEMV + top-k)."""
    spec = MoESpec(router=rspec, hidden_size=d, intermediate_size=inter)

    def make(g, dt):
        inputs = _moe_cases(t, d, inter, {"": rspec}, None)[0].make(g, dt)
        inputs.update(gate_up=_randn(g, 2 * n_shared * inter, d, dtype=dt, scale=d**-0.5),
                      down=_randn(g, d, n_shared * inter, dtype=dt, scale=(n_shared * inter) ** -0.5),
                      gate=_randn(g, rspec.num_experts, d, scale=2 * d**-0.5))
        return inputs

    def run(o, i):
        op = o.make_moe(spec)
        op.load_experts(i["w13"], i["w2"])
        op.fuse_shared_experts(i["gate_up"], i["down"])
        def mlp(x):
            return torch.nn.functional.linear(o.silu_and_mul(torch.nn.functional.linear(x, i["gate_up"])), i["down"])

        if from_hidden:
            return (op.forward_hidden(i["x"], i["gate"], i["bias"], shared_experts=mlp),)
        return (op.forward(i["x"], i["logits"], i["bias"], shared_experts=mlp),)

    name = f"{rspec.scoring_func} {rspec.topk_method} +{n_shared} shared experts{' from hidden' if from_hidden else ''}"
    return [Case("moe", f"{name} T={t} D={d} I={inter} E={rspec.num_experts} k={rspec.top_k}", make, run,
                 kind="layer")]


# ------------------------------------------------------------------ V4 attention


def _v4_attention_cases(shapes: str) -> list[Case]:
    from deepinfer.conformance.v4_cases import make_v4_inputs, run_v4_attention, v4_setups

    cases = []
    for name, setup in v4_setups(shapes).items():
        steps = ", ".join("+".join(str(n) for _, n in step) for step in setup.steps)
        cases.append(Case("v4_attention", f"{name} bs={setup.block_size} steps [{steps}]",
                          lambda g, dt, st=setup: make_v4_inputs(st, g, dt),
                          lambda o, i, st=setup: run_v4_attention(o, st, i), kind="layer",
                          dtypes=FP32 if setup.selects else None))
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
            *_silu_cases(7, 48),
            *_kv_write_cases(6, 16, 40, 11),
            *_route_cases(9, real=False),
            *_linear_cases(5, [(48, 64), (200, 136)]),
            *_mla_cases(mla, 16, {
                "prefill": ([7], [0]),
                "decode": ([1, 1, 1], [9, 20, 1]),
                "mixed chunked": ([5, 1, 3], [0, 12, 17]),
            }),
            *_mla_latent_cases(mla, 16, {"decode": ([1, 1, 1], [9, 20, 1]), "mixed": ([5, 1], [0, 12])}),
            *_moe_cases(9, 64, 32, router_specs(real=False), limit=0.5),
            *_moe_shared_cases(3, 64, 32, 2, router_specs(real=False)["v2-lite softmax greedy"], from_hidden=True),
            *_moe_shared_cases(5, 64, 32, 2, router_specs(real=False)["v3 sigmoid noaux_tc"], from_hidden=True),
            *_moe_shared_cases(20, 64, 32, 2, router_specs(real=False)["v2-lite softmax greedy"]),
            *_v4_attention_cases("tiny"),
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
            *_silu_cases(64, 1408),
            *_kv_write_cases(64, 16, 576, 200),
            *_route_cases(128, real=True),
            *_linear_cases(32, [(3072, 2048), (2112, 7168), (576, 2048)]),
            *_mla_cases(mla, 16, {
                "prefill": ([256], [0]),
                "decode": ([1] * 16, [int(x) for x in torch.linspace(1, 1000, 16)]),
                "mixed chunked": ([128, 1, 1, 64], [0, 300, 77, 512]),
            }),
            *_mla_latent_cases(mla, 64, {"decode": ([1] * 16, [int(x) for x in torch.linspace(1, 1500, 16)]),
                                         "mixed": ([64, 1, 1], [0, 300, 1000])}),
            *_moe_cases(32, 2048, 1408, routers, limit=10.0),
            # small decode batches (NVIDIA: direct mode; shared experts folded in at T=1, dense at T=32);
            # 16 experts of V2-Lite width keep the random weights quick to draw
            *_moe_cases(4, 2048, 1408, {"v3 sigmoid noaux_tc": RouterSpec(16, 6, "sigmoid", "noaux_tc", n_group=4,
                                                                          topk_group=2, norm_topk_prob=True,
                                                                          routed_scaling_factor=2.5)}, limit=None),
            *_moe_shared_cases(1, 2048, 1408, 2, RouterSpec(16, 6, "softmax", "greedy"), from_hidden=True),
            *_moe_shared_cases(32, 2048, 1408, 2, RouterSpec(16, 6, "softmax", "greedy")),
            *_v4_attention_cases("real"),
        ]
    raise ValueError(f"unknown conformance shapes {shapes!r} (choose 'tiny' or 'real')")
