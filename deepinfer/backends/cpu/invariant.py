"""Batch-invariant CPU ops: what the `cpu` backend runs under `batch_invariant` (DEEPINFER_BATCH_INVARIANT=1).

A row's bits must not depend on the other rows of its batch, on how the scheduler chunked its prompt, or on
whether a token came in a prefill or a decode step. Measured on this project's CPU machines (torch 2.13,
MKL 2024.2, AVX2), two things break that in plain torch, and each op here avoids them:

- GEMM: MKL picks its kernel from the shape. `x[:M] @ w` differs in the last bits from the first M rows
  of a larger product for M < 7. So every GEMM here (`row_chunked_mm`) runs in calls of exactly
  ROW_CHUNK rows, the last chunk zero-padded. Every row then goes through one call shape, whatever M is.
- elementwise transcendental ops (sigmoid, SiLU): torch's CPU loops run the vector code over full
  vectors and a scalar fallback on the tail. The two round differently, so an element's value depends on
  where the tensor ends. `padded_elementwise` runs them on a flat buffer padded to a multiple of
  ELEMENT_PAD, so that every element takes the vector path.

Torch's parallel loops split elementwise work at points that depend on the tensor's size, so invariant
mode runs with one intra-op thread; the backend enforces it. Row reductions over a fixed width (RMSNorm's
mean, row softmax) and correctly rounded ops (+, *, /, sqrt) are row-invariant as they stand; the per-op
tests check every op on the path.

Attention: every query token is computed one way. The absorbed MLA form runs over the latent cache with
the context in blocks of CTX_BLOCK entries, the last block padded and masked, and an online softmax merges
the blocks in order. A token in a 1000-token prefill, a chunk or a decode step gets the same bits. MoE:
one path whatever the batch: a per-expert gather, chunked GEMMs, and a combine in expert order.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from deepinfer.backend import (
    LinearMethod,
    MLAAttentionOp,
    MLASpec,
    MoEOp,
    MoESpec,
    gather_context,
    route,
    write_latent,
)

ROW_CHUNK = 16  # rows per GEMM call (>= 7, where MKL's small-M kernels stop)
ELEMENT_PAD = 64  # elementwise buffers padded to a multiple of this many elements (>= 2 AVX-512 vectors)
CTX_BLOCK = 64  # context entries per attention block


def row_chunked_mm(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w_t [K, N] in calls of exactly ROW_CHUNK rows: row i's bits do not depend on M."""
    m, k = x.shape
    x = x.contiguous()
    out = x.new_empty(m, w_t.shape[1])
    full = m - m % ROW_CHUNK
    for i in range(0, full, ROW_CHUNK):
        torch.mm(x[i: i + ROW_CHUNK], w_t, out=out[i: i + ROW_CHUNK])
    if full < m:
        pad = x.new_zeros(ROW_CHUNK, k)
        pad[: m - full] = x[full:]
        out[full:] = torch.mm(pad, w_t)[: m - full]
    return out


def padded_elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, over a contiguous buffer padded to a multiple of ELEMENT_PAD elements."""
    n = x.numel()
    size = -(-max(n, 1) // ELEMENT_PAD) * ELEMENT_PAD
    buf = x.new_zeros(size)
    buf[:n] = x.reshape(-1)
    return fn(buf)[:n].view(x.shape)


def silu_and_mul(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return padded_elementwise(F.silu, gate) * up


def score(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Router scores with the elementwise functions on padded buffers (softmax is row-wise already)."""
    logits = router_logits.float()
    if scoring_func == "sigmoid":
        return padded_elementwise(torch.sigmoid, logits)
    if scoring_func == "sqrtsoftplus":
        return padded_elementwise(lambda t: F.softplus(t).sqrt(), logits)
    return logits.softmax(dim=-1, dtype=torch.float32)


class InvariantLinear(LinearMethod):
    """Any scheme's weights as the wrapped method converts them, applied through row_chunked_mm."""

    def __init__(self, inner: LinearMethod):
        self.inner = inner
        self.scheme = inner.scheme

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        self.inner.process_weights(layer, compute_dtype)
        layer.invariant_weight_t = self.inner.dense_weight(layer).t()  # a view: no copy for dense weights

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = row_chunked_mm(x.reshape(-1, shape[-1]), layer.invariant_weight_t)
        if getattr(layer, "bias", None) is not None:
            y = y + layer.bias
        return y.view(*shape[:-1], y.shape[-1])

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        return self.inner.dense_weight(layer)


class InvariantMLAAttention(MLAAttentionOp):
    """Absorbed MLA for every token (prefill, chunks and decode alike), fp32 like the native oracle."""

    def __init__(self, spec: MLASpec):
        super().__init__(spec)
        self.w_uk: torch.Tensor | None = None  # [H, nope, L]
        self.w_uv_t: torch.Tensor | None = None  # [H, L, v]

    def load_kv_b_proj(self, weight: torch.Tensor) -> None:
        w_uk, w_uv = self.split_kv_b_proj(weight)
        self.w_uk = w_uk.float().contiguous()
        self.w_uv_t = w_uv.float().transpose(1, 2).contiguous()

    def forward(self, q, kv_c, k_pe, kv_cache, batch, group):
        s = self.spec
        self.check_inputs(q, kv_cache, self.w_uk is not None)
        write_latent(kv_cache, batch.slot_mapping[group], kv_c, k_pe)
        T, H, L = q.shape[0], s.num_heads, s.kv_lora_rank
        qf = q.float()
        q_nope, q_pe = qf[..., : s.qk_nope_head_dim], qf[..., s.qk_nope_head_dim:]
        q_lat = torch.stack([row_chunked_mm(q_nope[:, h], self.w_uk[h]) for h in range(H)], dim=1)  # [T, H, L]
        q_all = torch.cat([q_lat, q_pe], dim=-1)  # [T, H, L + R]
        out_lat = q.new_zeros(T, H, L, dtype=torch.float32)
        table = batch.block_tables[group]
        start = 0
        for i, (qlen, ctx) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu)):
            if qlen:
                entries = gather_context(kv_cache, table[i], ctx + qlen)  # [seq_len, L + R] fp32
                out_lat[start: start + qlen] = self._attend(q_all[start: start + qlen], entries, ctx)
            start += qlen
        out = torch.cat([row_chunked_mm(out_lat[:, h], self.w_uv_t[h]) for h in range(H)], dim=-1)
        return out.to(q.dtype)

    def _attend(self, q_all: torch.Tensor, entries: torch.Tensor, ctx: int) -> torch.Tensor:
        """q_all [n, H, L+R] for the tokens at positions ctx .. ctx+n-1; entries [ctx+n, L+R]. [n, H, L]."""
        s = self.spec
        n, H, W = q_all.shape
        L = s.kv_lora_rank
        rows = q_all.reshape(n * H, W)
        pos = (ctx + torch.arange(n)).repeat_interleave(H)  # each row's query position
        m = torch.full((n * H, 1), float("-inf"))
        den = torch.zeros(n * H, 1)
        acc = torch.zeros(n * H, L)
        ones = torch.ones(CTX_BLOCK, 1)
        for b0 in range(0, entries.shape[0], CTX_BLOCK):
            blk = entries.new_zeros(CTX_BLOCK, W)
            real = min(CTX_BLOCK, entries.shape[0] - b0)
            blk[:real] = entries[b0: b0 + real]
            scores = row_chunked_mm(rows, blk.t()) * s.softmax_scale  # [nH, B]
            idx = b0 + torch.arange(CTX_BLOCK)
            scores = scores.masked_fill((idx[None, :] > pos[:, None]) | (idx[None, :] >= b0 + real), float("-inf"))
            m_new = torch.maximum(m, scores.max(dim=-1, keepdim=True).values)
            alive = torch.isfinite(m_new)  # rows whose context starts later have seen nothing yet
            shift = torch.where(alive, m_new, torch.zeros_like(m_new))
            p = padded_elementwise(torch.exp, scores - shift)
            corr = padded_elementwise(torch.exp, torch.where(alive, m - shift, torch.zeros_like(m)))
            corr = torch.where(torch.isfinite(m), corr, torch.zeros_like(corr))
            den = den * corr + row_chunked_mm(p, ones)
            acc = acc * corr + row_chunked_mm(p, blk[:, :L].contiguous())
            m = m_new
        return (acc / den).view(n, H, L)


class InvariantMoE(MoEOp):
    """Route, then each expert over the tokens it got (chunked GEMMs), combined in expert order."""

    def __init__(self, spec: MoESpec):
        super().__init__(spec)
        self.w13_t: torch.Tensor | None = None  # [E, D, 2I]
        self.w2_t: torch.Tensor | None = None  # [E, I, D]

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.check_expert_shapes(w13, w2)
        self.w13_t = w13.transpose(1, 2)
        self.w2_t = w2.transpose(1, 2)

    def router_logits(self, x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
        return row_chunked_mm(x.float(), gate_weight.float().t())

    def expert_parallel_reasons(self) -> list[str]:
        return []

    def route(self, router_logits, correction_bias=None, token_ids=None, tid2eid=None):
        return route(router_logits, self.spec.router, correction_bias, token_ids, tid2eid, score_fn=score)

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each loaded expert over its tokens; a -1 id (another rank's expert) matches none of them."""
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(self.spec.local_experts):
            tok, slot = (topk_ids == e).nonzero(as_tuple=True)  # tokens in order: each expert's rows as a sorted set
            if tok.numel() == 0:
                continue
            h = silu_and_mul(row_chunked_mm(x[tok], self.w13_t[e]))
            y = row_chunked_mm(h, self.w2_t[e]).float() * topk_weights[tok, slot, None]
            out.index_add_(0, tok, y)  # per token: experts added in id order, whatever the batch
        return out.to(x.dtype)

    def forward(self, x, router_logits, correction_bias=None, token_ids=None, tid2eid=None, shared_experts=None):
        weights, ids = self.route(router_logits, correction_bias, token_ids, tid2eid)
        out = self.experts(x, weights, ids)
        if shared_experts is not None:
            out = out + shared_experts(x)
        return out
