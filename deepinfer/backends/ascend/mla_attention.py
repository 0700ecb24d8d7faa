"""MLA attention on torch_npu, the way vllm-ascend runs DeepSeek: a split cache (latent [nb, bs, 512] |
rope [nb, bs, 64]), the fused norm + RoPE + cache write, and npu_fused_infer_attention_score.

- the latent norm and RoPE: the contract's default composition (npu_rms_norm, then RoPE in torch), then a
  plain index_copy_ of latent / rope into their parts. npu_kv_rmsnorm_rope_cache (+ npu_interleave_rope for
  q_pe) would fuse the three, but it stores k_pe de-interleaved ([evens | odds]): attention would not
  change (one permutation on q and k), the cache's content would, and the conformance suite compares that
  content with the reference (so would prefix-cache tiers). Not used until the contract lets an op keep
  its cache content private (docs/ascend.md).
- decode rows (query_len 1): absorbed. q_nope @ W_UK (a batched matmul) gives 512-wide latent queries;
  the fused op runs paged attention over the latent cache (BSND, block_table, actual_seq_lengths_kv, the rope
  split as query_rope / key_rope); the latent output @ W_UV^T (batched matmul) gives the heads.
- prefill rows: each request's context latent is gathered and up-projected to k_nope / v per head; the
  fused op runs TND attention with the 64-wide rope split, sparse_mode 3 (causal aligned bottom-right, so a
  chunk attends to its cached prefix).
The fused op's MLA modes need kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128 and 1..128 heads (a
power of two): `fia_mla_reasons`; other shapes get the native op (the backend says so in op_impl).
"""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer.backend import ForwardBatch, MLAAttentionOp, MLASpec
from deepinfer.errors import BackendError

MASK_SIZE = 2048  # sparse_mode 3 takes this optimised causal mask
Q_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def fia_mla_reasons(spec: MLASpec) -> list[str]:
    """Why npu_fused_infer_attention_score's MLA modes cannot take this layer (empty: they can)."""
    why = []
    if spec.kv_lora_rank != 512:
        why.append(f"kv_lora_rank {spec.kv_lora_rank} != 512 (absorbed paged MLA)")
    if spec.qk_rope_head_dim != 64:
        why.append(f"qk_rope_head_dim {spec.qk_rope_head_dim} != 64")
    if spec.qk_nope_head_dim != 128 or spec.v_head_dim != 128:
        why.append(f"qk_nope / v head dims {spec.qk_nope_head_dim} / {spec.v_head_dim} != 128 (TND prefill)")
    if spec.num_heads not in Q_HEADS:
        why.append(f"{spec.num_heads} heads is not one of {Q_HEADS}")
    return why


class AscendMLAAttention(MLAAttentionOp):
    def __init__(self, spec: MLASpec, npu: ModuleType):
        super().__init__(spec)
        self.npu = npu
        self.w_uk: torch.Tensor | None = None  # [H, nope, L]
        self.w_uv_t: torch.Tensor | None = None  # [H, L, v]
        self._mask: torch.Tensor | None = None

    def load_kv_b_proj(self, weight: torch.Tensor) -> None:
        w_uk, w_uv = self.split_kv_b_proj(weight)
        self.w_uk = w_uk.contiguous()
        self.w_uv_t = w_uv.transpose(1, 2).contiguous()

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _parts(kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
            raise BackendError("the ascend MLA op reads the split layout (latent, rope): allocate the cache with "
                               "the backend's kv_cache_layout")
        return kv_cache[0], kv_cache[1]

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.device != device:
            self._mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)
        return self._mask

    @staticmethod
    def _write(latent: torch.Tensor, rope: torch.Tensor, slots: torch.Tensor, kv_c: torch.Tensor,
               k_pe: torch.Tensor) -> None:
        keep = slots >= 0  # -1: a padding row writes nothing
        idx = slots[keep]
        latent.view(-1, latent.shape[-1]).index_copy_(0, idx, kv_c[keep].to(latent.dtype))
        rope.view(-1, rope.shape[-1]).index_copy_(0, idx, k_pe[keep].to(rope.dtype))

    # ------------------------------------------------------------ the layer

    def forward(self, q, kv_c, k_pe, kv_cache, batch: ForwardBatch, group: str) -> torch.Tensor:
        self.check_inputs(q, kv_cache, loaded=self.w_uk is not None)
        latent, rope = self._parts(kv_cache)
        self._write(latent, rope, batch.slot_mapping[group], kv_c, k_pe)
        s = self.spec
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        return self._attend(q_nope, q_pe.contiguous(), latent, rope, batch, group)

    def _attend(self, q_nope, q_pe, latent, rope, batch: ForwardBatch, group: str) -> torch.Tensor:
        s, t = self.spec, q_nope.shape[0]
        if sum(batch.query_lens_cpu) != t:
            raise BackendError(f"MLA: batch query_lens_cpu sum to {sum(batch.query_lens_cpu)}, q has {t} rows")
        starts, start = [], 0
        for qlen in batch.query_lens_cpu:
            starts.append(start)
            start += qlen
        dec = [i for i, n in enumerate(batch.query_lens_cpu) if n == 1]
        pre = [i for i, n in enumerate(batch.query_lens_cpu) if n > 1]
        for i in dec + pre:
            if batch.seq_lens_cpu[i] != batch.context_lens_cpu[i] + batch.query_lens_cpu[i]:
                raise BackendError(f"MLA: request {i} has seq_len != context_len + query_len")
        out = torch.empty((t, s.num_heads, s.v_head_dim), dtype=q_nope.dtype, device=q_nope.device)
        if dec:
            rows = torch.tensor([starts[i] for i in dec], device=q_nope.device)
            out[rows] = self._decode(q_nope[rows], q_pe[rows], latent, rope, batch, group, dec)
        if pre:
            rows = torch.cat([torch.arange(starts[i], starts[i] + batch.query_lens_cpu[i]) for i in pre])
            rows = rows.to(q_nope.device)
            out[rows] = self._prefill(q_nope[rows], q_pe[rows], latent, rope, batch, group, pre)
        return out.reshape(t, s.num_heads * s.v_head_dim)

    def _decode(self, q_nope, q_pe, latent, rope, batch, group, reqs: list[int]) -> torch.Tensor:
        s, b = self.spec, q_nope.shape[0]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, H, L]: W_UK absorbed
        table = batch.block_tables[group][torch.tensor(reqs, device=latent.device)].to(torch.int32)
        out, _ = self.npu.npu_fused_infer_attention_score(
            q_lat.contiguous().view(b, 1, s.num_heads, -1), latent, latent,
            query_rope=q_pe.contiguous().view(b, 1, s.num_heads, -1), key_rope=rope,
            num_heads=s.num_heads, num_key_value_heads=1, input_layout="BSND", scale=s.softmax_scale,
            block_table=table, block_size=latent.shape[1], sparse_mode=0,
            actual_seq_lengths_kv=[batch.seq_lens_cpu[i] for i in reqs])
        return torch.bmm(out.view(b, s.num_heads, -1).transpose(0, 1), self.w_uv_t).transpose(0, 1)  # W_UV

    def _prefill(self, q_nope, q_pe, latent, rope, batch, group, reqs: list[int]) -> torch.Tensor:
        s, dev = self.spec, latent.device
        bs = latent.shape[1]
        slots = []
        for i in reqs:
            n = batch.seq_lens_cpu[i]
            blocks = batch.block_tables[group][i, : -(-n // bs)].to(torch.long)
            if bool((blocks < 0).any()):
                raise BackendError(f"MLA: block table row {i} does not cover {n} tokens")
            slots.append((blocks[:, None] * bs + torch.arange(bs, device=dev)).reshape(-1)[:n])
        slots = torch.cat(slots)
        lat = latent.view(-1, latent.shape[-1]).index_select(0, slots)  # [S, L]
        k_pe = rope.view(-1, rope.shape[-1]).index_select(0, slots)  # [S, R]
        k_nope = torch.einsum("sl,hnl->shn", lat, self.w_uk)
        v = torch.einsum("sl,hlv->shv", lat, self.w_uv_t)
        cum_q, cum_kv, a, b = [], [], 0, 0
        for i in reqs:
            a += batch.query_lens_cpu[i]
            b += batch.seq_lens_cpu[i]
            cum_q.append(a)
            cum_kv.append(b)
        out, _ = self.npu.npu_fused_infer_attention_score(
            q_nope.contiguous(), k_nope.contiguous(), v.contiguous(), query_rope=q_pe.contiguous(),
            key_rope=k_pe[:, None, :].expand(-1, s.num_heads, -1).contiguous(), num_heads=s.num_heads,
            num_key_value_heads=s.num_heads, input_layout="TND", scale=s.softmax_scale, sparse_mode=3,
            atten_mask=self._causal_mask(dev), actual_seq_lengths=cum_q, actual_seq_lengths_kv=cum_kv)
        return out
