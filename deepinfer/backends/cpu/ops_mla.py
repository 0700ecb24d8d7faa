"""MLA attention for the CPU: every decode row of a step in one batched absorbed attention.

The native op (deepinfer.backend.native.mla_attention, the reference this is checked against by the
conformance suite) loops over the requests of a step: per request a gather of its latent context,
then a handful of small matmuls. On a CPU with small models that loop is the step: at 16 decode
rows and 4 layers it is ~1,000 tiny torch calls whose dispatch costs more than their arithmetic.

Here the decode rows (query_len 1) of a step go together:

  1. one index_select of the rows' blocks from the paged cache -> latent [B, nb * block_size, L + R],
  2. q_lat = q_nope folded through W_UK (one bmm over the heads), cat q_pe -> [B, H, L + R],
  3. scores = scale * q_cat @ latent^T + mask (one baddbmm; -inf past each row's seq_len),
  4. softmax, out_lat = p @ latent (one bmm), out = out_lat through W_UV (one bmm over the heads).

Same math as the native absorbed decode, fp32 throughout, only the summation order differs (the
padding keys get probability exactly 0). The per-step plan (which blocks, the mask, the validity
check of the block tables) is built once per step and shared by every layer's op. Prefill rows
(query_len > 1) run the native per-request prefill on a gathered context.

An fp8 cache (EngineConfig.kv_cache_dtype="fp8") is written quantized and read dequantized exactly as the
native op does it (NativeMLAAttention.to_cache / from_cache: the per-layer kv_scale, ±448 clamp); torch's
CPU index_copy_ has no float8 kernel, so fp8 rows are copied as their bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer.backend import BackendError, MLASpec, NativeMLAAttention

if TYPE_CHECKING:
    from deepinfer.backend import ForwardBatch


def _parts(kv_cache) -> tuple[torch.Tensor, ...]:
    return tuple(kv_cache) if isinstance(kv_cache, (tuple, list)) else (kv_cache,)


class DecodePlan:
    """What every layer's decode attention of one step shares: the decode rows, their blocks, the mask."""

    __slots__ = ("rows", "all_decode", "block_idx", "nb", "mask")

    def __init__(self, batch: "ForwardBatch", group: str, num_blocks: int, block_size: int, device):
        qlens, seqs, ctxs = batch.query_lens_cpu, batch.seq_lens_cpu, batch.context_lens_cpu
        rows = [i for i, q in enumerate(qlens) if q == 1]
        for i in rows:
            if seqs[i] != ctxs[i] + 1:
                raise BackendError(f"MLA: request {i} has seq_len {seqs[i]} != context_len {ctxs[i]} + query_len 1")
        self.rows = rows
        self.all_decode = len(rows) == len(qlens)
        if not rows:
            return
        lens = [seqs[i] for i in rows]
        max_len = max(lens)
        self.nb = nb = -(-max_len // block_size)
        table = batch.block_tables[group]
        if table.shape[1] < nb:
            raise BackendError(f"MLA: block table has {table.shape[1]} columns, a request needs {nb}")
        if not self.all_decode:
            table = table[torch.tensor(rows, dtype=torch.long, device=table.device)]
        blocks = table[:, :nb].to(torch.long)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        need = torch.arange(nb, device=device)[None, :] * block_size < lens_t[:, None]
        if bool((need & ((blocks < 0) | (blocks >= num_blocks))).any()):
            bad = [i for i, row, n in zip(rows, blocks.tolist(), lens) if any(b < 0 or b >= num_blocks
                                                                              for b in row[: -(-n // block_size)])]
            raise BackendError(f"MLA: block table rows {bad} do not cover their sequences with valid blocks")
        self.block_idx = blocks.clamp(min=0).reshape(-1)  # unneeded -1 entries read block 0, masked below
        keys = torch.arange(nb * block_size, device=device)
        self.mask = torch.zeros((len(rows), 1, nb * block_size), dtype=torch.float32, device=device)
        self.mask.masked_fill_((keys[None, :] >= lens_t[:, None]).unsqueeze(1), float("-inf"))


class PlanCache:
    """The last step's plan, shared by the MLA ops of one backend (one model's layers)."""

    def __init__(self):
        self._key: tuple | None = None
        self._plan: DecodePlan | None = None

    def get(self, batch: "ForwardBatch", group: str, num_blocks: int, block_size: int, device) -> DecodePlan:
        """The plan for (this batch object, its block table tensor for `group`, the cache's shape); a
        batch is one step's and never changes once built (batch_builder makes a new one each step)."""
        table = batch.block_tables[group]
        key = (batch, table, group, num_blocks, block_size)
        cached = self._key
        if cached is not None and cached[0] is batch and cached[1] is table and cached[2:] == key[2:]:
            return self._plan
        plan = DecodePlan(batch, group, num_blocks, block_size, device)
        self._key, self._plan = key, plan
        return plan


def write_latent_fast(parts: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor, kv_c: torch.Tensor,
                      k_pe: torch.Tensor) -> None:
    """The native write_latent's effect (rows at their slots; slot -1 skipped), with one bounds check."""
    slots = slot_mapping.to(torch.long)
    if slots.numel() == 0:
        return
    lo, hi = torch.aminmax(slots)
    if int(lo) < 0:
        keep = slots >= 0
        slots, kv_c, k_pe = slots[keep], kv_c[keep], k_pe[keep]
        if slots.numel() == 0:
            return
        hi = slots.max()
    if len(parts) == 1:
        flat = parts[0].view(-1, parts[0].shape[-1])
        if int(hi) >= flat.shape[0]:
            raise BackendError(f"kv_cache_write: slot {int(hi)} is outside the cache ({flat.shape[0]} slots)")
        _copy_rows(flat, slots, torch.cat([kv_c, k_pe], dim=-1).to(flat.dtype))
        return
    if len(parts) != 2 or parts[0].shape[-1] != kv_c.shape[-1] or parts[1].shape[-1] != k_pe.shape[-1]:
        widths = [p.shape[-1] for p in parts]
        raise BackendError(f"MLA cache parts of widths {widths}: expected one part of "
                           f"{kv_c.shape[-1] + k_pe.shape[-1]} or latent {kv_c.shape[-1]} + rope {k_pe.shape[-1]}")
    for part, values in zip(parts, (kv_c, k_pe)):
        flat = part.view(-1, part.shape[-1])
        if int(hi) >= flat.shape[0]:
            raise BackendError(f"kv_cache_write: slot {int(hi)} is outside the cache ({flat.shape[0]} slots)")
        _copy_rows(flat, slots, values.to(flat.dtype))


def _copy_rows(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """flat[slots] = rows; 1-byte (fp8) rows as uint8, which index_copy_ supports on the CPU."""
    if flat.element_size() == 1 and flat.dtype != torch.uint8:
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


def gather_blocks(parts: tuple[torch.Tensor, ...], block_idx: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, nb * block_size, L + R] fp32: the blocks block_idx ([rows * nb]) of the cache, in order
    (fp8 values as stored: the op scales them, from_cache)."""
    got = []
    for p in parts:
        g = p.index_select(0, block_idx)  # [rows * nb, block_size, width]
        got.append(g.view(rows, -1, p.shape[-1]))
    lat = got[0] if len(got) == 1 else torch.cat(got, dim=-1)
    return lat.float()


class CPUMLAAttention(NativeMLAAttention):
    """NativeMLAAttention with the decode rows of a step batched (see the module docstring)."""

    def __init__(self, spec: MLASpec, plans: PlanCache | None = None):
        super().__init__(spec)
        self.plans = plans if plans is not None else PlanCache()
        self.w_uv_t: torch.Tensor | None = None  # [H, L, v] fp32

    def load_kv_b_proj(self, weight: torch.Tensor) -> None:
        super().load_kv_b_proj(weight)
        self.w_uv_t = self.w_uv.transpose(1, 2).contiguous()

    def decode_batched(self, q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, nope + rope] fp32, latent [B, S, L + R] fp32, mask [B, 1, S] -> [B, H, v] fp32."""
        s = self.spec
        q_nope, q_pe = q[..., : s.qk_nope_head_dim], q[..., s.qk_nope_head_dim :]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [H, B, L]
        q_cat = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1)  # [B, H, L + R]
        scores = torch.baddbmm(mask, q_cat, latent.transpose(1, 2), alpha=s.softmax_scale)  # [B, H, S]
        probs = scores.softmax(dim=-1)
        out_lat = torch.bmm(probs, latent[..., : s.kv_lora_rank])  # [B, H, L]
        return torch.bmm(out_lat.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [B, H, v]

    def forward_from_latent(self, q, kv_a, kv_norm_weight, eps, positions, rope_cache, interleaved, kv_cache,
                            batch, group, ops):
        """fp32 with interleaved RoPE (V3's layout): the rotation of q_pe and k_pe as one complex product
        each (the same x1 cos - x2 sin, x2 cos + x1 sin as the native op, ~10 torch calls instead of ~25);
        the latent norm is the backend's. Other dtypes / the halves layout: the default composition."""
        s = self.spec
        if not interleaved or q.dtype != torch.float32 or kv_a.dtype != torch.float32 or s.qk_rope_head_dim % 2:
            return super().forward_from_latent(q, kv_a, kv_norm_weight, eps, positions, rope_cache, interleaved,
                                               kv_cache, batch, group, ops)
        t, r, n = q.shape[0], s.qk_rope_head_dim, s.qk_nope_head_dim
        if rope_cache.shape[-1] != r:
            raise BackendError(f"rotary_embedding: q/k last dims {r}/{r} != cache width {rope_cache.shape[-1]}")
        kv_c, k_pe = kv_a.split([s.kv_lora_rank, r], dim=-1)
        kv_c = ops.rms_norm(kv_c.contiguous(), kv_norm_weight, eps)
        cs = rope_cache.index_select(0, positions.to(torch.long)).float()
        rot = torch.complex(cs[:, : r // 2], cs[:, r // 2 :])  # [T, R/2]
        q_pe = torch.view_as_complex(q[..., n:].contiguous().view(t, s.num_heads, r // 2, 2)) * rot[:, None]
        k_rot = torch.view_as_complex(k_pe.contiguous().view(t, r // 2, 2)) * rot
        q = torch.cat([q[..., :n], torch.view_as_real(q_pe).flatten(-2)], dim=-1)
        return self.forward(q, kv_c, torch.view_as_real(k_rot).flatten(-2), kv_cache, batch, group)

    def forward(self, q, kv_c, k_pe, kv_cache, batch, group):
        s = self.spec
        self.check_inputs(q, kv_cache, loaded=self.w_uk is not None)
        t = q.shape[0]
        qlens = batch.query_lens_cpu
        if sum(qlens) != t:
            raise BackendError(f"MLA: batch query_lens_cpu sum to {sum(qlens)}, q has {t} rows")
        parts = _parts(kv_cache)
        kv_dtype = parts[0].dtype
        write_latent_fast(parts, batch.slot_mapping[group], self.to_cache(kv_c, kv_dtype),
                          self.to_cache(k_pe, kv_dtype))
        num_blocks, block_size = parts[0].shape[:2]
        plan = self.plans.get(batch, group, num_blocks, block_size, q.device)
        if plan.all_decode:
            latent = self.from_cache(gather_blocks(parts, plan.block_idx, t), kv_dtype)
            out = self.decode_batched(q.float(), latent, plan.mask)
            return out.reshape(t, s.num_heads * s.v_head_dim).to(q.dtype)
        out = torch.empty((t, s.num_heads, s.v_head_dim), dtype=torch.float32, device=q.device)
        starts, start = [], 0
        for qlen in qlens:
            starts.append(start)
            start += qlen
        if plan.rows:
            idx = torch.tensor([starts[i] for i in plan.rows], dtype=torch.long, device=q.device)
            latent = self.from_cache(gather_blocks(parts, plan.block_idx, len(plan.rows)), kv_dtype)
            out[idx] = self.decode_batched(q.index_select(0, idx).float(), latent, plan.mask)
        table = batch.block_tables[group]
        for i, qlen in enumerate(qlens):
            if qlen <= 1:
                continue
            ctx, seq = batch.context_lens_cpu[i], batch.seq_lens_cpu[i]
            if seq != ctx + qlen:
                raise BackendError(f"MLA: request {i} has seq_len {seq} != context_len {ctx} + query_len {qlen}")
            nb = -(-seq // block_size)
            blocks = table[i, :nb].to(torch.long)
            if blocks.shape[0] < nb or bool(((blocks < 0) | (blocks >= num_blocks)).any()):
                raise BackendError(f"block table row does not cover {seq} tokens with valid blocks: "
                                   f"{table[i, :nb].tolist()}")
            latent = self.from_cache(gather_blocks(parts, blocks, 1)[0, :seq], kv_dtype)
            a = starts[i]
            out[a : a + qlen] = self.prefill(q[a : a + qlen].float(), latent, ctx)
        return out.reshape(t, s.num_heads * s.v_head_dim).to(q.dtype)
