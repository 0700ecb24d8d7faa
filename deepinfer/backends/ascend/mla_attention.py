"""MLA attention on torch_npu, the way vllm-ascend runs DeepSeek: a split cache (latent [nb, bs, 512] |
rope [nb, bs, 64]), the fused norm + RoPE + cache write, and npu_fused_infer_attention_score.

- the cache's rope part is stored de-interleaved ([evens | odds], KVPart.order = ROPE_ORDER), because
  npu_kv_rmsnorm_rope_cache writes it that way. Attention is unchanged (q_pe gets the same permutation:
  npu_interleave_rope emits it), and the layout declares the permutation, so KVLayout.join gives the
  contract's content back and the conformance suite still compares every cached value.
- forward_from_latent (interleaved RoPE, every slot real, not capturing): npu_kv_rmsnorm_rope_cache
  (RMSNorm of the latent, RoPE of k_pe, both written to the cache at the slots) + npu_interleave_rope for
  q_pe. Otherwise (the contract's default composition, or inside a graph capture, where padded rows carry
  slot -1 that the fused op does not document and repeated indices are undefined): npu_rms_norm, torch
  RoPE, then a graph-safe index_copy_ (padded rows rewrite row 0's slot with row 0's values).
- decode rows (query_len 1): absorbed. q_nope @ W_UK (a batched matmul) gives 512-wide latent queries;
  the fused op runs paged attention over the latent cache (BSND, block_table, actual_seq_lengths_kv, the rope
  split as query_rope / key_rope); the latent output @ W_UV^T (batched matmul) gives the heads. Inside a
  capture the call is an updatable graph task (graph_tasks.py).
- prefill rows: each request's context latent is gathered and up-projected to k_nope / v per head; the
  fused op runs TND attention with the 64-wide rope split, sparse_mode 3 (causal aligned bottom-right, so a
  chunk attends to its cached prefix).
- from the hidden states (forward_from_hidden, an optional capability of the contract the model asks for with
  prolog_reasons): npu_mla_prolog_v3 (mla_prolog.py) on all-decode batches, the projections + the path above
  otherwise (prefill rows need the un-absorbed q_nope, which the prolog does not return).
- the cache write: npu_scatter_pa_kv_cache (ND "Norm" mode, key = latent [T, 1, 512], value = rope [T, 1, 64])
  eagerly, after dropping padded rows; inside a capture the graph-safe index_copy_ below.
The fused op's MLA modes need kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128 and 1..128 heads (a
power of two): `fia_mla_reasons`; other shapes get the native op (the backend says so in op_impl), wrapped
in `PermutedRopeNativeMLA` when their cache uses the same split, permuted layout.
"""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer.backend import ForwardBatch, MLAAttentionOp, MLAPrologWeights, MLASpec, NativeMLAAttention
from deepinfer.backends.ascend import graph_tasks, mla_prolog
from deepinfer.errors import BackendError

MASK_SIZE = 2048  # sparse_mode 3 takes this optimised causal mask
Q_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
ROPE_ORDER = tuple(range(0, 64, 2)) + tuple(range(1, 64, 2))  # how npu_kv_rmsnorm_rope_cache stores k_pe


def _permute_rope(x: torch.Tensor) -> torch.Tensor:
    """[..., 64] in the contract's (interleaved-pair) order -> the stored [evens | odds] order."""
    return x.unflatten(-1, (32, 2)).transpose(-1, -2).flatten(-2)


class PermutedRopeNativeMLA(NativeMLAAttention):
    """The native op on the ascend layout: q_pe and k_pe get the stored permutation; q_pe . k_pe and so the
    attention are unchanged (for shapes the fused op refuses, e.g. a head count that is not a power of two)."""

    def forward(self, q, kv_c, k_pe, kv_cache, batch, group):
        s = self.spec
        q = torch.cat([q[..., : s.qk_nope_head_dim], _permute_rope(q[..., s.qk_nope_head_dim:])], dim=-1)
        return super().forward(q, kv_c, _permute_rope(k_pe), kv_cache, batch, group)


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
        self._prolog: mla_prolog.PrologTensors | None = None

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
    def _cos_sin(rope_cache: torch.Tensor, positions: torch.Tensor, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, 64] in dt: the 32 angles twice (the [evens | odds] halves share them)."""
        cs = rope_cache.index_select(0, positions.to(torch.long))  # [T, 64] fp32: cos 32 | sin 32
        return cs[:, :32].repeat(1, 2).to(dt), cs[:, 32:].repeat(1, 2).to(dt)

    def _write(self, latent: torch.Tensor, rope: torch.Tensor, slots: torch.Tensor, kv_c: torch.Tensor,
               k_pe: torch.Tensor) -> None:
        """slot -1 (a padding row) writes nothing. Eagerly: drop those rows, then npu_scatter_pa_kv_cache
        (its slots must lie in the cache and not repeat). Inside a capture (no host sync, static shapes):
        padded rows rewrite row 0's slot with row 0's values (always a real row: padding is at the tail; at
        capture time every static row is -1, hence the clamp), so the repeated indices carry equal values;
        the scatter op does not guarantee repeated slots, so index_copy_ does this write."""
        if not graph_tasks.capturing():
            keep = slots >= 0
            slots, kv_c, k_pe = slots[keep], kv_c[keep], k_pe[keep]
            nb, bs = latent.shape[:2]
            self.npu.npu_scatter_pa_kv_cache(
                kv_c.to(latent.dtype).contiguous().view(-1, 1, 512), k_pe.to(rope.dtype).contiguous().view(-1, 1, 64),
                latent.view(nb, bs, 1, 512), rope.view(nb, bs, 1, 64), slots.contiguous(), cache_mode="Norm")
            return
        if slots.numel():
            keep = (slots >= 0)[:, None]
            kv_c, k_pe = torch.where(keep, kv_c, kv_c[:1]), torch.where(keep, k_pe, k_pe[:1])
            slots = torch.where(keep[:, 0], slots, slots[:1]).clamp(min=0)
        latent.view(-1, latent.shape[-1]).index_copy_(0, slots, kv_c.to(latent.dtype))
        rope.view(-1, rope.shape[-1]).index_copy_(0, slots, k_pe.to(rope.dtype))

    # ------------------------------------------------------------ the layer

    def forward(self, q, kv_c, k_pe, kv_cache, batch: ForwardBatch, group: str) -> torch.Tensor:
        """q_pe / k_pe in the contract's order: permuted here to the stored order, then written and attended."""
        self.check_inputs(q, kv_cache, loaded=self.w_uk is not None)
        latent, rope = self._parts(kv_cache)
        self._write(latent, rope, batch.slot_mapping[group], kv_c, _permute_rope(k_pe))
        s = self.spec
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        return self._attend(q_nope, _permute_rope(q_pe).contiguous(), latent, rope, batch, group)

    def forward_from_latent(self, q, kv_a, kv_norm_weight, eps, positions, rope_cache, interleaved, kv_cache,
                            batch, group, ops):
        """npu_kv_rmsnorm_rope_cache + npu_interleave_rope where they compute the contract's layer (module
        docstring); the default composition otherwise."""
        slots = batch.slot_mapping[group]
        if not interleaved or graph_tasks.capturing() or not bool((slots >= 0).all()):
            return super().forward_from_latent(q, kv_a, kv_norm_weight, eps, positions, rope_cache, interleaved,
                                               kv_cache, batch, group, ops)
        self.check_inputs(q, kv_cache, loaded=self.w_uk is not None)
        s, t, dt = self.spec, q.shape[0], kv_a.dtype
        latent, rope = self._parts(kv_cache)
        nb, bs = latent.shape[:2]
        cos, sin = (c.view(t, 1, 1, 64) for c in self._cos_sin(rope_cache, positions, dt))
        self.npu.npu_kv_rmsnorm_rope_cache(
            kv_a.contiguous().view(t, 1, 1, s.cache_entry_dim), kv_norm_weight.to(dt), cos, sin, slots.to(torch.long),
            rope.view(nb, bs, 1, 64), latent.view(nb, bs, 1, 512), epsilon=eps, cache_mode="PA")
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        q_pe = self.npu.npu_interleave_rope(q_pe.contiguous().view(t, s.num_heads, 1, 64), cos, sin)
        return self._attend(q_nope, q_pe.view(t, s.num_heads, 64), latent, rope, batch, group)

    # ------------------------------------------------------------ from the hidden states

    def prolog_reasons(self, hidden_size: int, q_lora_rank: int, dtype: torch.dtype) -> list[str]:
        return mla_prolog.prolog_reasons(self.spec, hidden_size, q_lora_rank, dtype, self.npu)

    def load_prolog(self, weights: MLAPrologWeights) -> None:
        """Keeps the dense weights (the projections of batches the prolog does not take) and their NZ copies."""
        self.prolog = weights
        self._prolog = mla_prolog.prepare(self.npu, weights)

    def forward_from_hidden(self, x, positions, rope_cache, interleaved, kv_cache, batch, group, ops):
        """npu_mla_prolog_v3 + the paged decode on all-decode bf16 batches with interleaved RoPE (PA_BSND when
        every slot is real and nothing is captured, else TND + the graph-safe write); the contract's
        composition (projections, then forward_from_latent) otherwise."""
        if self._prolog is None or not interleaved or x.dtype != torch.bfloat16 or \
                any(n != 1 for n in batch.query_lens_cpu):
            return super().forward_from_hidden(x, positions, rope_cache, interleaved, kv_cache, batch, group, ops)
        s, t = self.spec, x.shape[0]
        if sum(batch.query_lens_cpu) != t:
            raise BackendError(f"MLA: batch query_lens_cpu sum to {sum(batch.query_lens_cpu)}, x has {t} rows")
        if self.w_uk is None:
            raise BackendError("MLA forward before load_kv_b_proj")
        hidden = self.prolog.q_a.shape[1]
        if tuple(x.shape) != (t, hidden):
            raise BackendError(f"MLA hidden states have shape {tuple(x.shape)}, expected [T, {hidden}]")
        latent, rope = self._parts(kv_cache)
        if (latent.shape[-1], rope.shape[-1]) != (512, 64):
            raise BackendError(f"MLA cache parts are {latent.shape[-1]} / {rope.shape[-1]} wide, expected 512 / 64")
        if any(sl != c + 1 for sl, c in zip(batch.seq_lens_cpu, batch.context_lens_cpu)):
            raise BackendError("MLA: a decode request has seq_len != context_len + 1")
        slots = batch.slot_mapping[group]
        paged = not graph_tasks.capturing() and bool((slots >= 0).all())
        cos, sin = self._cos_sin(rope_cache, positions, x.dtype)
        q_lat, q_pe, kv_c, k_pe = mla_prolog.run_prolog(self.npu, self._prolog, self.w_uk, x, cos, sin, latent, rope,
                                                        slots if paged else None)
        if not paged:
            self._write(latent, rope, slots, kv_c, k_pe)
        out = self._decode_latent(q_lat, q_pe, latent, rope, batch, group, None)
        return out.reshape(t, s.num_heads * s.v_head_dim)

    # ------------------------------------------------------------ attention

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
        if len(dec) == len(batch.query_lens_cpu):  # all decode (every captured graph): no row gathers
            out = self._decode(q_nope, q_pe, latent, rope, batch, group, None)
            return out.reshape(t, s.num_heads * s.v_head_dim)
        out = torch.empty((t, s.num_heads, s.v_head_dim), dtype=q_nope.dtype, device=q_nope.device)
        if dec:
            rows = torch.tensor([starts[i] for i in dec], device=q_nope.device)
            out[rows] = self._decode(q_nope[rows], q_pe[rows], latent, rope, batch, group, dec)
        if pre:
            rows = torch.cat([torch.arange(starts[i], starts[i] + batch.query_lens_cpu[i]) for i in pre])
            rows = rows.to(q_nope.device)
            out[rows] = self._prefill(q_nope[rows], q_pe[rows], latent, rope, batch, group, pre)
        return out.reshape(t, s.num_heads * s.v_head_dim)

    def _decode(self, q_nope, q_pe, latent, rope, batch, group, reqs: list[int] | None) -> torch.Tensor:
        """reqs None: every request of the batch, in order."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, H, L]: W_UK absorbed
        return self._decode_latent(q_lat, q_pe, latent, rope, batch, group, reqs)

    def _decode_latent(self, q_lat, q_pe, latent, rope, batch, group, reqs: list[int] | None) -> torch.Tensor:
        """Paged attention of absorbed queries [B, H, L] over the latent cache, then W_UV: [B, H, v]."""
        s, b = self.spec, q_lat.shape[0]
        table = batch.block_tables[group]
        if reqs is not None:
            table = table[torch.tensor(reqs, device=latent.device)]
        lens = list(batch.seq_lens_cpu) if reqs is None else [batch.seq_lens_cpu[i] for i in reqs]
        out = graph_tasks.fused_attention(
            self.npu, q_lat.contiguous().view(b, 1, s.num_heads, -1), latent, latent, lens,
            query_rope=q_pe.contiguous().view(b, 1, s.num_heads, -1), key_rope=rope,
            num_heads=s.num_heads, num_key_value_heads=1, input_layout="BSND", scale=s.softmax_scale,
            block_table=table.to(torch.int32), block_size=latent.shape[1], sparse_mode=0)
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
