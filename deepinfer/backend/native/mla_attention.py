"""MLA attention over the paged latent cache, in plain torch.

The cache holds one entry per token: kv_c (kv_lora_rank, normed latent) ||
k_pe (qk_rope_head_dim, RoPE applied). Two paths, chosen per request:

- query_len > 1 (prefill, or a chunk of it on top of a cached prefix): naive
  MHA. The request's whole context latent is gathered from its blocks and
  up-projected with kv_b into per-head k_nope and v; the causal mask is offset
  by context_len (query j sits at position context_len + j).
- query_len == 1 (decode): absorbed. q_nope is folded through W_UK into the
  latent space, scores are taken directly against the cached latents, and the
  latent-space output is projected through W_UV. Same math, no per-token
  up-projection of the context.

The cache is one tensor [num_blocks, block_size, L + R] (the default layout) or, where a backend
lays it out in two parts (KVLayout.split_last: latent | rope), the pair of tensors
([num_blocks, block_size, L], [num_blocks, block_size, R]); both are read and written here.

All arithmetic is fp32 (the oracle); the output is cast to q's dtype.

An fp8 cache (float8_e4m3fn parts: EngineConfig.kv_cache_dtype="fp8") is quantized on write and
dequantized on read with the op's per-layer `kv_scale` (kv_spec.quantize_kv / dequantize_kv: one scale for
the latent and the rope part, clamped to ±448); both paths then compute on the dequantized fp32 rows, so
this oracle is "dequantize, then the same math".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer.backend.kv_spec import dequantize_kv, is_fp8_kv, quantize_kv
from deepinfer.backend.layer_ops import MLAAttentionOp
from deepinfer.backend.native.kv_write import kv_cache_write
from deepinfer.backend.specs import MLASpec
from deepinfer.errors import BackendError

if TYPE_CHECKING:
    from deepinfer.backend.forward_batch import ForwardBatch

PREFILL_Q_BLOCK = 512


def cache_parts(kv_cache) -> tuple[torch.Tensor, ...]:
    """The cache as a tuple of [num_blocks, block_size, width] parts (one for the default layout)."""
    return tuple(kv_cache) if isinstance(kv_cache, (tuple, list)) else (kv_cache,)


def gather_context(kv_cache, block_row: torch.Tensor, seq_len: int, scale: float = 1.0) -> torch.Tensor:
    """The first seq_len cache entries of one request, in token order: [seq_len, entry] (fp32; the parts
    of a split layout concatenated back into latent || rope; an fp8 cache dequantized with `scale`)."""
    parts = cache_parts(kv_cache)
    num_blocks, block_size = parts[0].shape[:2]
    nblocks = -(-seq_len // block_size)
    blocks = block_row[:nblocks].to(torch.long)
    if blocks.shape[0] < nblocks or bool((blocks < 0).any()) or bool((blocks >= num_blocks).any()):
        raise BackendError(
            f"block table row does not cover {seq_len} tokens with valid blocks: {block_row[:nblocks].tolist()}"
        )
    offsets = torch.arange(block_size, device=parts[0].device)
    slots = (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[:seq_len]
    rows = [dequantize_kv(p.view(-1, p.shape[-1]).index_select(0, slots), scale) for p in parts]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=-1)


def write_latent(kv_cache, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                 scale: float = 1.0) -> None:
    """Store this step's (kv_c || k_pe) rows at their slots, in either layout (quantized with `scale` into
    an fp8 cache)."""
    parts = cache_parts(kv_cache)
    if len(parts) == 1:
        kv_cache_write(parts[0], slot_mapping, quantize_kv(torch.cat([kv_c, k_pe], dim=-1), parts[0].dtype, scale))
    elif len(parts) == 2 and parts[0].shape[-1] == kv_c.shape[-1] and parts[1].shape[-1] == k_pe.shape[-1]:
        kv_cache_write(parts[0], slot_mapping, quantize_kv(kv_c, parts[0].dtype, scale))
        kv_cache_write(parts[1], slot_mapping, quantize_kv(k_pe, parts[1].dtype, scale))
    else:
        widths = [p.shape[-1] for p in parts]
        raise BackendError(f"MLA cache parts of widths {widths}: expected one part of "
                           f"{kv_c.shape[-1] + k_pe.shape[-1]} or latent {kv_c.shape[-1]} + rope {k_pe.shape[-1]}")


class NativeMLAAttention(MLAAttentionOp):
    def __init__(self, spec: MLASpec):
        super().__init__(spec)
        self.w_uk: torch.Tensor | None = None  # [H, qk_nope, kv_lora_rank] fp32
        self.w_uv: torch.Tensor | None = None  # [H, v_head, kv_lora_rank] fp32

    def to_cache(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows as the cache of `dtype` stores them (fp8: quantized with kv_scale), for subclasses' writes."""
        return quantize_kv(values, dtype, self.kv_scale)

    def from_cache(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows read from a cache of `dtype` (as stored, or already cast to fp32) as fp32: fp8 ones
        dequantized with kv_scale; for subclasses' reads."""
        x = rows.float()
        return x * self.kv_scale if is_fp8_kv(dtype) and self.kv_scale != 1.0 else x

    def load_kv_b_proj(self, weight: torch.Tensor) -> None:
        w_uk, w_uv = self.split_kv_b_proj(weight)
        self.w_uk, self.w_uv = w_uk.float().contiguous(), w_uv.float().contiguous()

    # ------------------------------------------------------------ paths

    def prefill(self, q: torch.Tensor, latent: torch.Tensor, context_len: int) -> torch.Tensor:
        """q [Q, H, nope+rope] fp32, latent [S, L+R] fp32 -> [Q, H, v] fp32 (naive MHA, causal).

        Queries go in blocks of PREFILL_Q_BLOCK rows so the [H, Q, S] score tensor stays bounded
        on long prompts (results agree across blockings to fp32 rounding).
        """
        s = self.spec
        lat, k_pe = latent[:, : s.kv_lora_rank], latent[:, s.kv_lora_rank :]
        k_nope = torch.einsum("sl,hnl->hsn", lat, self.w_uk)
        v = torch.einsum("sl,hvl->hsv", lat, self.w_uv)
        kpos = torch.arange(latent.shape[0], device=q.device)
        out = []
        for a in range(0, q.shape[0], PREFILL_Q_BLOCK):
            qb = q[a : a + PREFILL_Q_BLOCK]
            q_nope, q_pe = qb[..., : s.qk_nope_head_dim], qb[..., s.qk_nope_head_dim :]
            scores = torch.einsum("qhn,hsn->hqs", q_nope, k_nope) + torch.einsum("qhr,sr->hqs", q_pe, k_pe)
            scores = scores * s.softmax_scale
            qpos = context_len + a + torch.arange(qb.shape[0], device=q.device)
            scores = scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
            out.append(torch.einsum("hqs,hsv->qhv", scores.softmax(dim=-1), v))
        return torch.cat(out)

    def decode(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """q [1, H, nope+rope] fp32, latent [S, L+R] fp32 -> [1, H, v] fp32 (absorbed)."""
        s = self.spec
        lat, k_pe = latent[:, : s.kv_lora_rank], latent[:, s.kv_lora_rank :]
        q_nope, q_pe = q[0, :, : s.qk_nope_head_dim], q[0, :, s.qk_nope_head_dim :]
        q_lat = torch.einsum("hn,hnl->hl", q_nope, self.w_uk)
        scores = (q_lat @ lat.T + q_pe @ k_pe.T) * s.softmax_scale
        out_lat = scores.softmax(dim=-1) @ lat
        return torch.einsum("hl,hvl->hv", out_lat, self.w_uv)[None]

    # ------------------------------------------------------------ layer

    def forward(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache,
        batch: "ForwardBatch",
        group: str,
    ) -> torch.Tensor:
        s = self.spec
        self.check_inputs(q, kv_cache, loaded=self.w_uk is not None)
        t = q.shape[0]
        if sum(batch.query_lens_cpu) != t:
            raise BackendError(f"MLA: batch query_lens_cpu sum to {sum(batch.query_lens_cpu)}, q has {t} rows")
        write_latent(kv_cache, batch.slot_mapping[group], kv_c, k_pe, self.kv_scale)
        block_tables = batch.block_tables[group]
        out = torch.empty((t, s.num_heads, s.v_head_dim), dtype=torch.float32, device=q.device)
        start = 0
        for i, qlen in enumerate(batch.query_lens_cpu):
            if qlen == 0:
                continue
            ctx, seq = batch.context_lens_cpu[i], batch.seq_lens_cpu[i]
            if seq != ctx + qlen:
                raise BackendError(f"MLA: request {i} has seq_len {seq} != context_len {ctx} + query_len {qlen}")
            latent = gather_context(kv_cache, block_tables[i], seq, self.kv_scale)
            rows = q[start : start + qlen].float()
            if qlen == 1:
                out[start : start + 1] = self.decode(rows, latent)
            else:
                out[start : start + qlen] = self.prefill(rows, latent, ctx)
            start += qlen
        return out.reshape(t, s.num_heads * s.v_head_dim).to(q.dtype)
