"""The MLA attention layer on NVIDIA: Triton KV write, prefill and absorbed decode.

Decode rows (query_len == 1) fold q_nope through W_UK, run the split-KV latent
kernel over the paged cache, and project the latent output through W_UV.
Prefill rows (query_len > 1, possibly on top of a cached prefix) gather their
context latents, up-project them to per-head k_nope / v with two GEMMs, and run
causal varlen flash attention. The same split as the torch-native oracle, so
both are comparable request by request.

A short extend over a long cached context (a prefix-cache hit recomputing its last block, a speculative
verify row, a small chunk after a long one) is neither: up-projecting 8k context tokens for 64 queries
costs two large GEMMs per layer and the prefill kernel's grid (query blocks x heads) leaves the GPU
nearly idle. Such a request's query tokens run as absorbed decode rows instead: token j of a request
with context c is a decode row of seq_len c + j + 1 over the same block table (causal by construction),
through the split-KV decode kernel (`extend_as_decode`; DEEPINFER_MLA_EXTEND_AS_DECODE_MAX_QUERY).

`forward_from_latent` (what the model calls) runs the latent norm, RoPE (q_pe
rotated in place) and KV write as one kernel (mla_prep); for a decode-only
batch that launch also absorbs q_nope through W_UK, and at small batches the
split merge applies W_UV (mla_decode), so a decode layer's attention is
GEMM, prep, split, merge, o_proj: no elementwise copies, no torch.cat. A
decode-only batch makes no host sync and allocates only fixed-size tensors per
batch size, so it can be captured in a CUDA graph.

fp8 KV cache (a float8_e4m3fn cache, EngineConfig.kv_cache_dtype="fp8"): the writes (mla_prep,
kv_cache_write_parts) store clamp(x / kv_scale, ±448) in e4m3; decode converts the stored values in
registers (mla_decode); prefill dequantizes the context rows it gathers anyway (to q's dtype, times
kv_scale) before the up-projection GEMMs. kv_scale is per layer, 1.0 unless a checkpoint gives one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer import envs
from deepinfer.backend import MLAAttentionOp, MLASpec
from deepinfer.backends.nvidia.kv_write import kv_cache_write_parts
from deepinfer.backends.nvidia.mla_decode import mla_decode
from deepinfer.backends.nvidia.mla_prep import mla_prep
from deepinfer.backends.nvidia.prefill_attention import prefill_attention
from deepinfer.errors import BackendError

if TYPE_CHECKING:
    from deepinfer.backend import ForwardBatch

EXTEND_AS_DECODE_MIN_CONTEXT = 256  # shorter contexts: the prefill path's up-projection is cheap


def extend_as_decode(query_len: int, context_len: int, max_query: int) -> bool:
    """Whether an extend of `query_len` tokens over `context_len` cached ones runs as decode rows."""
    return (1 < query_len <= max_query and context_len >= EXTEND_AS_DECODE_MIN_CONTEXT
            and context_len >= 4 * query_len)


class TritonMLAAttention(MLAAttentionOp):
    fuse_absorb = True  # decode: W_UK absorb inside the mla_prep launch (False: a cuBLAS batched GEMM)

    def __init__(self, spec: MLASpec):
        super().__init__(spec)
        self.w_uk: torch.Tensor | None = None  # [H, qk_nope, L]
        self.w_uv_t: torch.Tensor | None = None  # [H, L, v]
        self.w_uk_flat: torch.Tensor | None = None  # [H * qk_nope, L]
        self.w_uv_flat: torch.Tensor | None = None  # [H * v, L]

    def load_kv_b_proj(self, weight: torch.Tensor) -> None:
        w_uk, w_uv = self.split_kv_b_proj(weight)
        self.w_uk, w_uv = w_uk.contiguous(), w_uv.contiguous()
        L = self.spec.kv_lora_rank
        self.w_uv_t = w_uv.transpose(1, 2).contiguous()
        self.w_uk_flat = self.w_uk.reshape(-1, L)
        self.w_uv_flat = w_uv.reshape(-1, L)

    # ------------------------------------------------------------ paths

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, q_lat: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, nope+rope] (rows may be strided) -> [B, H, v], contiguous (absorbed, paged latent cache).

        No elementwise copies: the head-batched GEMMs (W_UK when q_lat is not given, W_UV at larger
        batches) read and write strided views ([H, B, .] over [B, H, .] memory), which cuBLAS takes as
        leading dimensions; q_pe is read in place.
        """
        s = self.spec
        B = q.shape[0]
        w_uk, w_uv_t = self._weights(q.dtype)
        if q_lat is None:  # not absorbed by mla_prep already
            q_lat = torch.empty((B, s.num_heads, s.kv_lora_rank), dtype=q.dtype, device=q.device)
            torch.bmm(q[..., : s.qk_nope_head_dim].transpose(0, 1), w_uk, out=q_lat.transpose(0, 1))
        # W_UV: fused into the split merge at small batches, a batched GEMM otherwise (see mla_decode)
        return mla_decode(q_lat, kv_cache, block_table, seq_lens, s.kv_lora_rank, s.softmax_scale,
                          q_pe=q[..., s.qk_nope_head_dim :], w_uv_t=w_uv_t, kv_scale=self.kv_scale)

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, L], W_UV^T [H, L, v]) in `dtype`; the load dtype needs no conversion."""
        if self.w_uk.dtype == dtype:
            return self.w_uk, self.w_uv_t
        return self.w_uk.to(dtype), self.w_uv_t.to(dtype)

    def prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """q [sum q_len, H, nope+rope] of the plan's prefill requests -> [.., H, v]."""
        s = self.spec
        dev = q.device
        latent = kv_cache.view(-1, s.cache_entry_dim).index_select(0, plan.pre_gather)
        if latent.dtype == torch.float8_e4m3fn:  # the gathered rows, dequantized before the GEMMs read them
            latent = latent.to(q.dtype) if self.kv_scale == 1.0 else (latent.float() * self.kv_scale).to(q.dtype)
        lat, k_pe = latent[:, : s.kv_lora_rank], latent[:, s.kv_lora_rank :]
        tk = latent.shape[0]
        k = torch.empty((tk, s.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim), dtype=q.dtype, device=dev)
        k[..., : s.qk_nope_head_dim] = (lat @ self.w_uk_flat.to(q.dtype).t()).view(tk, s.num_heads, -1)
        k[..., s.qk_nope_head_dim :] = k_pe[:, None, :]
        v = (lat @ self.w_uv_flat.to(q.dtype).t()).view(tk, s.num_heads, s.v_head_dim)
        return prefill_attention(q, k, v, plan.pre_cu_q, plan.pre_cu_k, plan.pre_max_q, s.softmax_scale)

    # ------------------------------------------------------------ layer

    def forward(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                batch: ForwardBatch, group: str) -> torch.Tensor:
        self._check(q, kv_cache, batch)
        kv_cache_write_parts(kv_cache, batch.slot_mapping[group], kv_c, k_pe, self.kv_scale)
        return self._attend(q, kv_cache, batch, group)

    def forward_from_latent(self, q, kv_a, kv_norm_weight, eps, positions, rope_cache, interleaved, kv_cache,
                            batch, group, ops) -> torch.Tensor:
        """One kernel for kv_a norm + RoPE (q_pe rotated in place in q) + KV write, then the attention.
        A decode-only batch also absorbs q_nope through W_UK in that launch (fuse_absorb)."""
        self._check(q, kv_cache, batch)
        decode_only = all(n == 1 for n in batch.query_lens_cpu)
        w_uk = self._weights(q.dtype)[0] if decode_only and self.fuse_absorb else None
        q_lat = mla_prep(q, kv_a, kv_norm_weight, eps, positions, rope_cache, interleaved, kv_cache,
                         batch.slot_mapping[group], w_uk=w_uk, kv_scale=self.kv_scale)
        if q_lat is not None:
            return self.decode(q, kv_cache, batch.block_tables[group], batch.seq_lens, q_lat).view(q.shape[0], -1)
        return self._attend(q, kv_cache, batch, group)

    def _check(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch) -> None:
        self.check_inputs(q, kv_cache, loaded=self.w_uk is not None)
        if sum(batch.query_lens_cpu) != q.shape[0]:
            raise BackendError(f"MLA: batch query_lens_cpu sum to {sum(batch.query_lens_cpu)}, q has {q.shape[0]} rows")

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, group: str) -> torch.Tensor:
        """Attention over the cache, which already holds this step's entries."""
        s = self.spec
        t = q.shape[0]
        tables = batch.block_tables[group]
        if batch.is_decode_only:  # no host sync, graph-capturable
            return self.decode(q, kv_cache, tables, batch.seq_lens).view(t, -1)
        max_query = envs.MLA_EXTEND_AS_DECODE_MAX_QUERY.get()
        plan = batch.memo(("nvidia_mla_plan", group, kv_cache.shape[1], max_query),
                          lambda: step_plan(batch, group, kv_cache.shape[1], max_query, q.device))
        out = torch.empty((t, s.num_heads, s.v_head_dim), dtype=q.dtype, device=q.device)
        if plan.dec_rows is not None:
            out[plan.dec_rows] = self.decode(q[plan.dec_rows], kv_cache, plan.dec_tables, plan.dec_lens)
        if plan.ext_rows is not None:  # token j of request i: a decode row of seq_len context + j + 1
            out[plan.ext_rows] = self.decode(q[plan.ext_rows], kv_cache, plan.ext_tables, plan.ext_lens)
        if plan.pre_rows is not None:
            out[plan.pre_rows] = self.prefill(q[plan.pre_rows].contiguous(), kv_cache, plan)
        return out.reshape(t, -1)


@dataclass
class StepPlan:
    """One step's split of a mixed batch into decode rows, extend-as-decode rows and prefill rows, with the
    index tensors each path needs: built once per batch (ForwardBatch.memo) and shared by every layer."""

    dec_rows: torch.Tensor | None = None  # [D] token rows of the decode requests
    dec_tables: torch.Tensor | None = None  # [D, W] their block tables
    dec_lens: torch.Tensor | None = None  # [D] their seq_lens
    ext_rows: torch.Tensor | None = None  # [E] token rows of the extends run as decode rows
    ext_tables: torch.Tensor | None = None
    ext_lens: torch.Tensor | None = None  # [E] context + j + 1 for token j
    pre_rows: torch.Tensor | None = None  # [P] token rows of the prefill requests
    pre_gather: torch.Tensor | None = None  # [sum seq_len] cache rows (block * page + offset) of their contexts
    pre_cu_q: torch.Tensor | None = None
    pre_cu_k: torch.Tensor | None = None
    pre_max_q: int = 0


def step_plan(batch: ForwardBatch, group: str, page: int, max_query: int, dev: torch.device) -> StepPlan:
    qlens, ctxs, seqs = batch.query_lens_cpu, batch.context_lens_cpu, batch.seq_lens_cpu
    for i, (n, ctx, sl) in enumerate(zip(qlens, ctxs, seqs)):
        if sl != ctx + n:
            raise BackendError(f"MLA: request {i} has seq_len {sl} != context_len {ctx} + query_len {n}")
    tables = batch.block_tables[group]
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    dec = [i for i, n in enumerate(qlens) if n == 1]
    ext = [i for i, n in enumerate(qlens) if extend_as_decode(n, ctxs[i], max_query)]
    pre = [i for i, n in enumerate(qlens) if n > 1 and i not in ext]
    plan = StepPlan()
    if dec:
        idx = torch.tensor(dec, device=dev)
        plan.dec_rows = torch.tensor([starts[i] for i in dec], device=dev)
        plan.dec_tables, plan.dec_lens = tables[idx], batch.seq_lens[idx]
    if ext:
        rows_l, idx_l, lens_l = [], [], []
        for i in ext:
            rows_l += range(starts[i], starts[i] + qlens[i])
            idx_l += [i] * qlens[i]
            lens_l += range(ctxs[i] + 1, ctxs[i] + qlens[i] + 1)
        plan.ext_rows = torch.tensor(rows_l, device=dev)
        plan.ext_tables = tables[torch.tensor(idx_l, device=dev)].contiguous()
        plan.ext_lens = torch.tensor(lens_l, dtype=batch.seq_lens.dtype, device=dev)
    if pre:
        p_seqs = [seqs[i] for i in pre]
        p_q = [qlens[i] for i in pre]
        plan.pre_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in pre]).to(dev)
        req = torch.repeat_interleave(torch.tensor(pre), torch.tensor(p_seqs)).to(dev)
        pos = torch.cat([torch.arange(n) for n in p_seqs]).to(dev)
        plan.pre_gather = tables[req, pos // page].to(torch.int64) * page + pos % page
        plan.pre_cu_q = torch.tensor([0, *itertools.accumulate(p_q)], dtype=torch.int32, device=dev)
        plan.pre_cu_k = torch.tensor([0, *itertools.accumulate(p_seqs)], dtype=torch.int32, device=dev)
        plan.pre_max_q = max(p_q)
    return plan
