"""Shared helpers of tests/nvidia/test_invariant_*.py: a paged latent cache driven chunk by chunk.

Imported after nvidia_testutil (which sets TRITON_INTERPRET on a machine without a GPU).
"""

from __future__ import annotations

import torch

from deepinfer.backend import ForwardBatch, MLASpec


class PagedCache:
    """A paged latent cache with hand-made block tables: sequence s owns blocks s * per_seq .. (s+1) * per_seq - 1.

    `run(op, chunks)` calls op.forward for one step holding the given chunks (a chunk of one token is a
    decode row), after the chunks before it, as the engine would.
    """

    def __init__(self, spec: MLASpec, page: int, blocks_per_seq: int, num_seqs: int, dtype: torch.dtype,
                 device: torch.device):
        self.spec, self.page, self.per = spec, page, blocks_per_seq
        self.kv = torch.zeros(num_seqs * blocks_per_seq, page, spec.kv_lora_rank + spec.qk_rope_head_dim,
                              dtype=dtype, device=device)
        self.lens: dict[int, int] = {}

    def batch(self, chunks: list[tuple[int, int]]) -> ForwardBatch:
        """chunks: (seq id, new tokens); advances the lengths."""
        dev = self.kv.device
        slots, qlens, ctxs, pos = [], [], [], []
        for sid, n in chunks:
            ctx = self.lens.get(sid, 0)
            slots += [(sid * self.per + (ctx + j) // self.page) * self.page + (ctx + j) % self.page for j in range(n)]
            pos += [ctx + j for j in range(n)]
            qlens.append(n), ctxs.append(ctx)
            self.lens[sid] = ctx + n
        table = torch.tensor([[sid * self.per + b for b in range(self.per)] for sid, _ in chunks], dtype=torch.int32)
        seq = [c + n for c, n in zip(ctxs, qlens)]
        i32 = dict(dtype=torch.int32, device=dev)
        return ForwardBatch(
            input_ids=torch.zeros(sum(qlens), dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), **i32),
            seq_lens=torch.tensor(seq, **i32), context_lens=torch.tensor(ctxs, **i32),
            block_tables={"mla": table.to(dev)},
            slot_mapping={"mla": torch.tensor(slots, dtype=torch.int64, device=dev)},
            logits_indices=torch.arange(sum(qlens), device=dev), query_lens_cpu=qlens, seq_lens_cpu=seq,
            context_lens_cpu=ctxs, block_size=self.page,
        )

    def run(self, op, chunks: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """chunks: (seq, q [n, H, nope+rope], kv_c [n, L], k_pe [n, R]) -> each chunk's output rows."""
        batch = self.batch([(sid, q.shape[0]) for sid, q, _, _ in chunks])
        out = op.forward(torch.cat([c[1] for c in chunks]), torch.cat([c[2] for c in chunks]),
                         torch.cat([c[3] for c in chunks]), self.kv, batch, "mla")
        return list(out.split(batch.query_lens_cpu))


def seq_inputs(spec: MLASpec, n: int, seed: int, dtype: torch.dtype, device: torch.device):
    """Random (q, kv_c, k_pe) for n tokens of one sequence."""
    g = torch.Generator().manual_seed(seed)
    H, nope, rope, L = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    return tuple(t.to(dtype).to(device) for t in (torch.randn(n, H, nope + rope, generator=g),
                                                   torch.randn(n, L, generator=g), torch.randn(n, rope, generator=g)))


def rows_invariant(fn, x: torch.Tensor, sizes, probe) -> dict:
    """fn over x[:M] for every M in sizes: the probed rows equal (bitwise) fn over each row alone. Returns
    {M: fn over x[:M]} (a caller checking the whole batch's values too reuses the run of M = len(x))."""
    alone = {i: fn(x[i: i + 1].clone()) for i in probe}
    outs = {}
    for m in sizes:
        out = outs[m] = fn(x[:m].clone())
        for i in probe:
            if i < m:
                assert torch.equal(out[i: i + 1], alone[i]), f"row {i} differs inside a batch of {m}"
    return outs


def folded_shared_moe(spec, w13: torch.Tensor, w2: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor):
    """(the invariant MoE with the shared MLP folded into its grouped GEMMs, the native MoE over the same experts,
    the shared MLP as the model runs it apart): the setup of the folded-shared-expert tests, interpreter and GPU."""
    import torch.nn.functional as F

    from deepinfer.backend.native.moe import NativeMoE
    from deepinfer.backends.nvidia.invariant.moe import InvariantMoE

    def shared(t: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(t, gate_up).chunk(2, -1)
        return F.linear(F.silu(g) * u, down)

    inv, ref = InvariantMoE(spec), NativeMoE(spec)
    inv.load_experts(w13, w2)
    ref.load_experts(w13, w2)
    assert inv.fuse_shared_experts(gate_up, down)
    return inv, ref, shared
