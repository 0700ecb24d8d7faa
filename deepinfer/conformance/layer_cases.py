"""Conformance cases of the whole-layer ops: MLA attention (paged latent cache, prefill / decode /
mixed, from projections, from the latent or from the hidden states), MoE (every router, shared experts, from hidden
states) and DeepSeek-V4 attention. The cache is built in the default layout and handed to the op
in the layout its backend declares (`Backend.kv_cache_layout`), so a backend that splits the
latent and rope parts is checked on its own layout.
"""

from __future__ import annotations

import torch

from deepinfer.backend import ForwardBatch, KVCacheSpec, KVLayout, MLAPrologWeights, MLASpec, MoESpec, RouterSpec
from deepinfer.backend.native.rope import rope_cos_sin_cache
from deepinfer.conformance.cases_base import FP32, Case
from deepinfer.conformance.cases_base import randn as _randn
from deepinfer.conformance.cases_base import router_inputs as _router_inputs


def mla_layout(o, spec: MLASpec, dtype: torch.dtype) -> KVLayout:
    """The layout `o` (a backend, or the native reference) keeps an MLA group in."""
    return o.kv_cache_layout(KVCacheSpec("mla", (0,), (spec.cache_entry_dim,), dtype))


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


def mla_cases(spec: MLASpec, block_size: int, batches: dict[str, tuple[list[int], list[int]]]) -> list[Case]:
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
            layout = mla_layout(o, spec, i["cache"].dtype)
            cache = layout.split(i["cache"].clone())
            out = op.forward(i["q"], i["kv_c"], i["k_pe"], cache, i["batch"], "mla")
            return out, layout.join(cache)

        desc = f"{label} q={_lens(qlens)} ctx={_lens(ctxs)} H={spec.num_heads} L={spec.kv_lora_rank}"
        cases.append(Case("mla_attention", desc, make, run, kind="layer", spec=spec))
    return cases


def mla_latent_cases(spec: MLASpec, block_size: int, batches: dict[str, tuple[list[int], list[int]]]) -> list[Case]:
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
                layout = mla_layout(o, spec, i["cache"].dtype)
                cache = layout.split(i["cache"].clone())
                b = i["batch"]
                out = op.forward_from_latent(i["q"].clone(), i["kv_a"], i["w"], 1e-6, b.positions, i["rope"], inter,
                                             cache, b, "mla", o)
                return out, layout.join(cache)

            desc = (f"from latent ({'interleaved' if interleaved else 'halves'}) {label} q={_lens(qlens)} "
                    f"ctx={_lens(ctxs)} H={spec.num_heads} L={spec.kv_lora_rank}")
            cases.append(Case("mla_attention", desc, make, run, kind="layer", spec=spec))
    return cases


def mla_prolog_cases(spec: MLASpec, hidden: int, q_lora_rank: int, block_size: int,
                     batches: dict[str, tuple[list[int], list[int], bool]]) -> list[Case]:
    """The layer from the hidden states (q_a / kv_a projections, q_a norm, q_b, then forward_from_latent): an op
    whose prolog_reasons are empty runs forward_from_hidden (Ascend: npu_mla_prolog_v3 on decode batches), any
    other runs the model's own composition; the oracle always composes. batches: label -> (qlens, ctxs,
    interleaved RoPE)."""
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    cases = []
    for label, (qlens, ctxs, interleaved) in batches.items():
        def make(g, dt, qlens=qlens, ctxs=ctxs):
            t, blocks, common = _mla_inputs(spec, block_size, qlens, ctxs, g, dt)
            del common["q"]
            return {
                **common,
                "x": _randn(g, t, hidden, dtype=dt),
                "q_a": _randn(g, q_lora_rank, hidden, dtype=dt, scale=hidden**-0.5),
                "q_a_norm": _randn(g, q_lora_rank, dtype=dt, scale=0.5) + 1,
                "q_b": _randn(g, spec.num_heads * qk, q_lora_rank, dtype=dt, scale=q_lora_rank**-0.5),
                "kv_a": _randn(g, spec.cache_entry_dim, hidden, dtype=dt, scale=2 * hidden**-0.5),
                "w": _randn(g, spec.kv_lora_rank, dtype=dt, scale=0.5) + 1,
                "rope": rope_cos_sin_cache(spec.qk_rope_head_dim, 2048, 10000.0, yarn),
                "cache": _randn(g, blocks, block_size, spec.cache_entry_dim, dtype=dt),
            }

        def run(o, i, inter=interleaved):
            op = o.make_mla_attention(spec)
            op.load_kv_b_proj(i["kv_b"])
            layout = mla_layout(o, spec, i["cache"].dtype)
            cache = layout.split(i["cache"].clone())
            b, x, eps = i["batch"], i["x"], 1e-6
            w = MLAPrologWeights(q_a=i["q_a"], q_a_norm=i["q_a_norm"], q_b=i["q_b"], kv_a=i["kv_a"],
                                 kv_a_norm=i["w"], eps=eps)
            if not op.prolog_reasons(hidden, q_lora_rank, x.dtype):
                op.load_prolog(w)
                out = op.forward_from_hidden(x, b.positions, i["rope"], inter, cache, b, "mla", o)
            else:  # the model's own path (models/layers/mla.py)
                q_a = o.rms_norm(torch.nn.functional.linear(x, w.q_a), w.q_a_norm, eps)
                q = torch.nn.functional.linear(q_a, w.q_b).view(x.shape[0], spec.num_heads, qk)
                out = op.forward_from_latent(q, torch.nn.functional.linear(x, w.kv_a), w.kv_a_norm, eps,
                                             b.positions, i["rope"], inter, cache, b, "mla", o)
            return out, layout.join(cache)

        desc = (f"from hidden ({'interleaved' if interleaved else 'halves'}) {label} q={_lens(qlens)} "
                f"ctx={_lens(ctxs)} D={hidden} q_lora={q_lora_rank} H={spec.num_heads} L={spec.kv_lora_rank}")
        cases.append(Case("mla_attention", desc, make, run, kind="layer", spec=spec))
    return cases


# ------------------------------------------------------------------ MoE


def moe_cases(t: int, d: int, inter: int, routers: dict[str, RouterSpec], limit: float | None) -> list[Case]:
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
        cases.append(Case("moe", f"{name} T={t} D={d} I={inter} E={rspec.num_experts}{lim}", make, run, kind="layer",
                          spec=spec))
    return cases


def moe_shared_cases(t: int, d: int, inter: int, n_shared: int, rspec: RouterSpec,
                      from_hidden: bool = False) -> list[Case]:
    """Routed + shared experts through MoEOp.fuse_shared_experts / forward(shared_experts=...): an op may run
    the shared MLP as extra experts (NVIDIA at small T) or call it; either must equal native routed + MLP.
    from_hidden: through forward_hidden with the fp32 router gate (NVIDIA fuses the gate GEMV + top-k)."""
    spec = MoESpec(router=rspec, hidden_size=d, intermediate_size=inter)

    def make(g, dt):
        inputs = moe_cases(t, d, inter, {"": rspec}, None)[0].make(g, dt)
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
                 kind="layer", spec=spec)]


# ------------------------------------------------------------------ V4 attention


def v4_attention_cases(shapes: str) -> list[Case]:
    from deepinfer.conformance.v4_cases import make_v4_inputs, run_v4_attention, v4_setups

    cases = []
    for name, setup in v4_setups(shapes).items():
        steps = ", ".join("+".join(str(n) for _, n in step) for step in setup.steps)
        cases.append(Case("v4_attention", f"{name} bs={setup.block_size} steps [{steps}]",
                          lambda g, dt, st=setup: make_v4_inputs(st, g, dt),
                          lambda o, i, st=setup: run_v4_attention(o, st, i), kind="layer",
                          dtypes=FP32 if setup.selects else None))
    return cases
