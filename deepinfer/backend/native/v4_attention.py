"""Torch-native DeepSeek-V4 attention layer over the hybrid paged cache (the oracle).

Per request of the batch (query rows at positions context_len .. seq_len-1):
1. sliding window: keys of positions (t - W, t] — the last W-1 cached ones
   read from the paged `swa_group`, the step's own from `kv`; new keys are
   written where slot_mapping >= 0;
2. compressor (CSA / HCA): windows closed by this step become entries,
   appended to the paged `comp_group` (entry e in block e // block_size);
   the raw projections of the newest positions go to the per-sequence ring
   (KVCaches.state, row batch.state_slots[i]);
3. CSA: the indexer compresses its own keys the same way (`index_group`)
   and picks, per query, the top-k causal entries (ties: lowest index);
   HCA: every causal entry (e < (t + 1) // m) is visible;
4. softmax over [window keys, visible entries, per-head sink] with K = V.

Prefix caching (kv/state_snapshots.py) passes `state_snapshots`: its `plan[i]` lists (B, slot) for the
block boundaries B inside request i's step; the ring a sequence would hold with B tokens computed is
written to `state_snapshots.rings[(group, layer)][slot]` before the step's own ring update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer.backend.layer_ops import V4AttentionOp
from deepinfer.backend.native.v4_compressor import compress_windows, gather_projections, update_ring
from deepinfer.backend.native.v4_indexer import causal_entry_mask, indexer_scores, select_topk
from deepinfer.backend.specs import V4AttentionSpec
from deepinfer.errors import BackendError

if TYPE_CHECKING:
    from deepinfer.backend.forward_batch import ForwardBatch
    from deepinfer.backend.kv_caches import KVCaches


def _paged_index(block_row: torch.Tensor, start: int, end: int, block_size: int, what: str):
    """(block ids, offsets) of entries [start, end) of one request; a freed block is an error."""
    idx = torch.arange(start, end, device=block_row.device)
    bidx = idx // block_size
    if end > start and int(bidx[-1]) >= block_row.shape[0]:
        raise BackendError(f"{what}: entry {end - 1} lies past the request's block table ({block_row.shape[0]} blocks)")
    blocks = block_row[bidx].long()
    if bool((blocks < 0).any()):
        raise BackendError(f"{what}: entries [{start}, {end}) need a block the KV manager has not assigned")
    return blocks, idx % block_size


def read_entries(cache: torch.Tensor, block_row: torch.Tensor, start: int, end: int, what: str) -> torch.Tensor:
    blocks, offs = _paged_index(block_row, start, end, cache.shape[1], what)
    return cache[blocks, offs]


class NativeV4Attention(V4AttentionOp):
    def __init__(self, spec: V4AttentionSpec):
        super().__init__(spec)
        if spec.compress_rate and spec.comp_group is None:
            raise BackendError("V4 attention with a compressor needs comp_group")
        if spec.overlap and (spec.index_group is None or spec.index_n_heads <= 0 or spec.index_topk <= 0):
            raise BackendError("V4 CSA attention needs index_group, index_n_heads > 0 and index_topk > 0")
        self.w: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        need = ["sinks"]
        if self.spec.compress_rate:
            need += ["rope_inv_freq", "compressor.position_bias", "compressor.norm_weight"]
        if self.spec.overlap:
            need += ["indexer.position_bias", "indexer.norm_weight"]
        missing = [k for k in need if k not in weights]
        if missing:
            raise BackendError(f"V4 attention load_weights lacks {missing}")
        self.w = {k: v.float() for k, v in weights.items()}

    # ------------------------------------------------------------ pieces

    def _window_keys(self, kv_new, caches, layer_id, batch, i, ctx):
        s = self.spec
        cache = caches.get(s.swa_group, layer_id)
        lo = max(0, ctx - s.sliding_window + 1)
        past = read_entries(cache, batch.block_tables[s.swa_group][i], lo, ctx, "sliding-window keys")
        return torch.cat([past.to(kv_new.dtype), kv_new], dim=0), lo

    def _compress(self, group, prefix, kv, gate, caches, layer_id, slot, ctx, seq, block_row, overlap, new_slots,
                  snaps=None, snap_rings=None):
        """New entries of this step appended to `group` at their slots (new_slots: the request's rows of
        batch.slot_mapping[group], -1 for tokens that complete no entry); returns all entries [0, seq // m)."""
        s = self.spec
        m = s.compress_rate
        ring = caches.get_state(group, layer_id)[slot]
        p_kv, p_gate, base = gather_projections(ring, ctx, kv, gate, m, overlap)
        new = compress_windows(
            p_kv, p_gate, base, ctx // m, seq // m, m, overlap,
            self.w[f"{prefix}.position_bias"], self.w[f"{prefix}.norm_weight"], s.norm_eps,
            self.w["rope_inv_freq"], s.rope_attention_factor,
        )
        for boundary, dst in snaps or ():  # the ring at each block boundary inside the step (prefix caching)
            image = ring.clone()
            update_ring(image, ctx, kv[: boundary - ctx], gate[: boundary - ctx])
            snap_rings[(group, layer_id)][dst] = image
        update_ring(ring, ctx, kv, gate)
        cache = caches.get(group, layer_id)
        targets = new_slots[new_slots >= 0]
        if targets.shape[0] != new.shape[0]:
            raise BackendError(f"{group}: {new.shape[0]} new entries but slot_mapping names {targets.shape[0]} slots")
        if new.shape[0]:
            cache.view(-1, *cache.shape[2:])[targets] = new.to(cache.dtype)
        old = read_entries(cache, block_row, 0, ctx // m, f"{group} entries")
        return torch.cat([old.to(new.dtype), new], dim=0)

    # ------------------------------------------------------------ forward

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        caches: "KVCaches",
        layer_id: int,
        batch: "ForwardBatch",
        comp_kv: torch.Tensor | None = None,
        comp_gate: torch.Tensor | None = None,
        index_q: torch.Tensor | None = None,
        index_weights: torch.Tensor | None = None,
        index_kv: torch.Tensor | None = None,
        index_gate: torch.Tensor | None = None,
        state_snapshots=None,
    ) -> torch.Tensor:
        s = self.spec
        if s.compress_rate and (comp_kv is None or comp_gate is None):
            raise BackendError("V4 attention with a compressor needs comp_kv and comp_gate")
        if s.overlap and any(x is None for x in (index_q, index_weights, index_kv, index_gate)):
            raise BackendError("V4 CSA attention needs the indexer's q, weights, kv and gate")
        out = torch.empty_like(q)
        qsl = batch.query_start_loc.tolist()
        slots = batch.state_slots_cpu
        swa_slots = batch.slot_mapping[s.swa_group]
        swa_cache = caches.get(s.swa_group, layer_id)
        plan = state_snapshots.plan if state_snapshots is not None else None
        rings = state_snapshots.rings if plan is not None else None
        for i, ctx in enumerate(batch.context_lens_cpu):
            a, b = qsl[i], qsl[i + 1]
            if a == b:
                continue
            seq = ctx + (b - a)
            tpos = batch.positions[a:b]
            keys, lo = self._window_keys(kv[a:b], caches, layer_id, batch, i, ctx)
            kpos = torch.arange(lo, seq, device=q.device)
            mask = (kpos[None, :] <= tpos[:, None]) & (kpos[None, :] > tpos[:, None] - s.sliding_window)
            if s.compress_rate:
                if not slots:
                    raise BackendError("V4 compressed attention needs batch.state_slots (per-sequence state rows)")
                row = batch.block_tables[s.comp_group][i]
                snaps = plan[i] if plan is not None else None
                entries = self._compress(s.comp_group, "compressor", comp_kv[a:b], comp_gate[a:b], caches,
                                         layer_id, slots[i], ctx, seq, row, s.overlap,
                                         batch.slot_mapping[s.comp_group][a:b], snaps, rings)
                visible = causal_entry_mask(tpos, entries.shape[0], s.compress_rate)
                if s.overlap:
                    irow = batch.block_tables[s.index_group][i]
                    ikeys = self._compress(s.index_group, "indexer", index_kv[a:b], index_gate[a:b], caches,
                                           layer_id, slots[i], ctx, seq, irow, True,
                                           batch.slot_mapping[s.index_group][a:b], snaps, rings)
                    scores = indexer_scores(index_q[a:b], ikeys, index_weights[a:b], s.index_head_dim**-0.5)
                    visible = select_topk(scores, visible, s.index_topk)
                keys = torch.cat([keys, entries.to(keys.dtype)], dim=0)
                mask = torch.cat([mask, visible], dim=1)
            out[a:b] = self._attend(q[a:b], keys, mask)
        valid = swa_slots >= 0
        if bool(valid.any()):
            swa_cache.view(-1, s.head_dim)[swa_slots[valid]] = kv[valid].to(swa_cache.dtype)
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """softmax([q.k * scale, sink]) @ k per head, fp32; the sink only takes probability mass."""
        logits = torch.einsum("lhd,nd->hln", q.float(), keys.float()) * self.spec.softmax_scale
        logits = logits.masked_fill(~mask[None], float("-inf"))
        sinks = self.w["sinks"].view(-1, 1, 1).expand(-1, q.shape[0], 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hln,nd->lhd", probs, keys.float()).to(q.dtype)
