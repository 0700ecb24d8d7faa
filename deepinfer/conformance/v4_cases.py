"""Conformance cases for the DeepSeek-V4 attention op (`Backend.make_v4_attention`).

The op owns its cache layout (sliding-window keys, compressed entries, indexer
keys, compressor rings), so a case never compares caches: it runs the same
steps through the backend's op and through the native one, each on its own
hybrid paged cache, and compares every step's output. The later steps read
what the earlier ones wrote, so a wrong write, ring or paging shows up there.

Each case is a list of steps of (request, new tokens), scheduled like the
engine does: block tables per group grow as the KV manager grows them
(compressed groups: ceil((tokens // m) / block_size) blocks), sliding-window
blocks wholly older than the window are freed (-1) and reused at once by
later allocations, state rows are shuffled and those of fresh sequences zeroed
(as the model runner does); everything else in the caches starts as garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backend import ForwardBatch, KVCaches, KVCacheSpec, V4AttentionSpec, token_slots
from deepinfer.backend.native.v4_compressor import ring_len
from deepinfer.backend.native.v4_rope import v4_inv_freq

LAYER = 1  # the op runs layer 1 of groups holding layers (0, 1): it must touch its own layer only


@dataclass(frozen=True)
class V4Setup:
    spec: V4AttentionSpec
    rope_dim: int
    block_size: int
    steps: tuple[tuple[tuple[int, int], ...], ...]  # per step: (request id, new tokens) in batch order
    # CSA with more causal entries than index_topk: the top-k really selects. Selection is
    # discrete, and in bf16 / fp16 two correct implementations may round an indexer key
    # differently and pick the other side of a near-tie, so these cases run in fp32 only;
    # the low-precision rows use a CSA case whose top-k keeps every causal entry.
    selects: bool = False


def v4_kv_specs(spec: V4AttentionSpec, dtype: torch.dtype) -> list[KVCacheSpec]:
    """The groups the op reads and writes, laid out as the V4 model declares them."""
    layers = (0, LAYER)
    out = [KVCacheSpec(spec.swa_group, layers, (spec.head_dim,), dtype, sliding_window=spec.sliding_window)]
    if spec.compress_rate:
        m, width = spec.compress_rate, (2 if spec.overlap else 1) * spec.head_dim
        out.append(KVCacheSpec(spec.comp_group, layers, (spec.head_dim,), dtype, tokens_per_entry=m,
                               state_shape=(ring_len(m, spec.overlap), 2 * width), state_dtype=dtype))
        if spec.overlap:
            di = spec.index_head_dim
            out.append(KVCacheSpec(spec.index_group, layers, (di,), dtype, tokens_per_entry=m,
                                   state_shape=(ring_len(m, True), 4 * di), state_dtype=dtype))
    return out


def _table_len(spec: KVCacheSpec, tokens: int, block_size: int) -> int:
    return -(-(tokens // spec.tokens_per_entry) // block_size)


def _schedule(setup: V4Setup, specs: list[KVCacheSpec], g: torch.Generator) -> tuple[list[dict], dict[str, int], int]:
    """Block tables, slots and state rows of every step; (steps, blocks per group, state rows)."""
    bs = setup.block_size
    rids = sorted({r for step in setup.steps for r, _ in step})
    total = {r: sum(n for step in setup.steps for q, n in step if q == r) for r in rids}
    pool = {s.name: sum(_table_len(s, total[r], bs) for r in rids) + 2 for s in specs}
    free = {n: torch.randperm(k, generator=g).tolist() for n, k in pool.items()}  # a stack: freed blocks reused first
    rows = torch.randperm(len(rids) + 1, generator=g).tolist()
    tables = {r: {s.name: [] for s in specs} for r in rids}
    lens = {r: 0 for r in rids}
    out = []
    for step in setup.steps:
        for r, _ in step:  # the KV manager frees dead window blocks before it grows the tables
            for s in specs:
                if s.sliding_window is not None:
                    t = tables[r][s.name]
                    for j in range(min(s.first_live_entry(lens[r]) // bs, len(t))):
                        if t[j] >= 0:
                            free[s.name].append(t[j])
                            t[j] = -1
        for r, n in step:
            for s in specs:
                t = tables[r][s.name]
                while len(t) < _table_len(s, lens[r] + n, bs):
                    t.append(free[s.name].pop())
        ctx = [lens[r] for r, _ in step]
        qlens = [n for _, n in step]
        out.append({
            "ctx": ctx, "qlens": qlens, "rows": [rows[rids.index(r)] for r, _ in step],
            "tables": {s.name: [list(tables[r][s.name]) for r, _ in step] for s in specs},
            "tokens_per_entry": {s.name: s.tokens_per_entry for s in specs},
        })
        for r, n in step:
            lens[r] += n
    return out, pool, len(rids) + 1


def _batch(sched: dict, block_size: int) -> ForwardBatch:
    ctx, qlens = sched["ctx"], sched["qlens"]
    seqs = [c + q for c, q in zip(ctx, qlens)]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    positions = torch.tensor([p for c, q in zip(ctx, qlens) for p in range(c, c + q)], dtype=torch.long)
    req_idx = torch.repeat_interleave(torch.arange(len(qlens)), torch.tensor(qlens))
    tables, slots = {}, {}
    for name, rows in sched["tables"].items():
        width = max(1, max(len(r) for r in rows))
        tables[name] = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)
        slots[name] = token_slots(tables[name], req_idx, positions, sched["tokens_per_entry"][name], block_size)
    return ForwardBatch(
        input_ids=torch.zeros(qsl[-1], dtype=torch.long),
        positions=positions,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seqs, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=slots,
        logits_indices=torch.tensor(qsl[1:], dtype=torch.long) - 1,
        query_lens_cpu=list(qlens), seq_lens_cpu=seqs, context_lens_cpu=list(ctx),
        state_slots=torch.tensor(sched["rows"], dtype=torch.int32), state_slots_cpu=list(sched["rows"]),
        block_size=block_size,
    )


def _randn(g: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def make_v4_inputs(setup: V4Setup, g: torch.Generator, dt: torch.dtype) -> dict:
    """Weights, garbage-filled caches, and per step a ForwardBatch plus the op's activations (CPU)."""
    s = setup.spec
    specs = v4_kv_specs(s, dt)
    sched, pool, nrows = _schedule(setup, specs, g)
    H, D, m = s.num_heads, s.head_dim, s.compress_rate
    weights = {"sinks": _randn(g, H, scale=0.5)}
    if m:
        width = (2 if s.overlap else 1) * D
        weights.update({"rope_inv_freq": v4_inv_freq(setup.rope_dim, 160000.0),
                        "compressor.position_bias": _randn(g, m, width, scale=0.5),
                        "compressor.norm_weight": _randn(g, D, scale=0.1) + 1})
    if s.overlap:
        di = s.index_head_dim
        weights.update({"indexer.position_bias": _randn(g, m, 2 * di, scale=0.5),
                        "indexer.norm_weight": _randn(g, di, scale=0.1) + 1})
    kv = {f"{sp.name}/{layer}": _randn(g, pool[sp.name], setup.block_size, *sp.entry_shape, dtype=dt)
          for sp in specs for layer in sp.layer_ids}
    state = {f"{sp.name}/{layer}": _randn(g, nrows, *sp.state_shape, dtype=dt)
             for sp in specs if sp.state_shape for layer in sp.layer_ids}
    steps = []
    for sc in sched:
        t = sum(sc["qlens"])
        acts = {"q": _randn(g, t, H, D, dtype=dt), "kv": _randn(g, t, D, dtype=dt)}
        if m:
            acts.update(comp_kv=_randn(g, t, width, dtype=dt), comp_gate=_randn(g, t, width, dtype=dt))
        if s.overlap:
            hi, di = s.index_n_heads, s.index_head_dim
            acts.update(index_q=_randn(g, t, hi, di, dtype=dt), index_weights=_randn(g, t, hi, scale=hi**-0.5),
                        index_kv=_randn(g, t, 2 * di, dtype=dt), index_gate=_randn(g, t, 2 * di, dtype=dt))
        steps.append({"batch": _batch(sc, setup.block_size), "acts": acts})
    return {"weights": weights, "kv": kv, "state": state, "steps": steps, "block_size": setup.block_size}


def run_v4_attention(ops, setup: V4Setup, inputs: dict) -> tuple[torch.Tensor, ...]:
    """Every step through `ops.make_v4_attention` on a private copy of the caches; the outputs of all steps."""
    s = setup.spec
    op = ops.make_v4_attention(s)
    op.load_weights(inputs["weights"])
    dt = inputs["steps"][0]["acts"]["q"].dtype
    specs = v4_kv_specs(s, dt)
    caches = KVCaches(specs={sp.name: sp for sp in specs}, block_size=inputs["block_size"])
    for key, t in inputs["kv"].items():
        name, layer = key.rsplit("/", 1)
        caches.kv[(name, int(layer))] = t.clone()
    for key, t in inputs["state"].items():
        name, layer = key.rsplit("/", 1)
        caches.state[(name, int(layer))] = t.clone()
    outs = []
    for step in inputs["steps"]:
        batch = step["batch"]
        fresh = [r for r, c in zip(batch.state_slots_cpu, batch.context_lens_cpu) if c == 0]
        for t in caches.state.values():  # the model runner zeroes the state rows of fresh sequences
            t[fresh] = 0
        outs.append(op.forward(step["acts"]["q"], step["acts"]["kv"], caches, LAYER, batch,
                               **{k: v for k, v in step["acts"].items() if k not in ("q", "kv")}))
    return tuple(outs)


def _spec(kind: str, H: int, D: int, W: int, m: int, hi: int = 0, di: int = 0, topk: int = 0) -> V4AttentionSpec:
    csa = kind == "csa"
    return V4AttentionSpec(
        num_heads=H, head_dim=D, sliding_window=W, softmax_scale=D**-0.5, swa_group="v4_swa",
        compress_rate=0 if kind == "swa" else m, overlap=csa, comp_group={"csa": "v4_csa", "hca": "v4_hca"}.get(kind),
        index_group="v4_idx" if csa else None, index_n_heads=hi if csa else 0, index_head_dim=di if csa else 0,
        index_topk=topk if csa else 0, rope_attention_factor=1.0 if kind == "swa" else 1.1,
    )


def v4_setups(shapes: str) -> dict[str, V4Setup]:
    """name -> setup. Step 1 prefills two requests; later steps mix a prefill chunk on a cached
    prefix, a decode and a fresh prompt in one batch, then decode all of them."""
    if shapes == "tiny":
        H, D, R, W, bs = 4, 32, 8, 8, 4
        steps = (((0, 70), (1, 37)), ((0, 13), (1, 1), (2, 9)), ((2, 1), (0, 1), (1, 1)))
        return {
            "swa W=8": V4Setup(_spec("swa", H, D, W, 0), R, bs, (((0, 21), (1, 6)), ((0, 5), (1, 1), (2, 3)))),
            "hca m=16 W=8": V4Setup(_spec("hca", H, D, W, 16), R, bs, steps),
            "csa-select m=4 W=8 Hi=8 Di=16 topk=4": V4Setup(_spec("csa", H, D, W, 4, 8, 16, 4), R, bs, steps, True),
            "csa m=4 W=8 Hi=8 Di=16 topk=32 (all entries)": V4Setup(_spec("csa", H, D, W, 4, 8, 16, 32), R, bs, steps),
        }
    if shapes == "real":
        # V4-Flash per-layer widths (64 heads of 512, rope 64, W=128, m=4 / 128, 64 indexer heads of 128);
        # the CSA prefix (2100 tokens, in chunks) passes 512 entries so the top-512 really selects
        H, D, R, W, bs = 64, 512, 64, 128, 16
        hca_steps = (((0, 300), (1, 130)), ((0, 64), (1, 1), (2, 17)), ((2, 1), (0, 1), (1, 1)))
        csa_prefix = tuple(((0, 256), (1, 30)) if i == 0 else ((0, 256),) for i in range(8))
        csa_steps = csa_prefix + (((0, 52),), ((0, 64), (1, 1), (2, 17)), ((2, 1), (0, 1), (1, 1)))
        return {
            "swa W=128 H=64 D=512": V4Setup(_spec("swa", H, D, W, 0), R, bs, hca_steps),
            "hca m=128 W=128 H=64 D=512": V4Setup(_spec("hca", H, D, W, 128), R, bs, hca_steps),
            "csa-select m=4 W=128 H=64 D=512 Hi=64 Di=128 topk=512":
                V4Setup(_spec("csa", H, D, W, 4, 64, 128, 512), R, bs, csa_steps, True),
            "csa m=4 W=128 H=64 D=512 Hi=64 Di=128 topk=512 (all entries)":
                V4Setup(_spec("csa", H, D, W, 4, 64, 128, 512), R, bs, hca_steps),
        }
    raise ValueError(f"unknown conformance shapes {shapes!r} (choose 'tiny' or 'real')")
