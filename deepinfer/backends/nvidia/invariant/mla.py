"""`InvariantMLAAttention`: absorbed MLA for every token (prefill, chunked prefill, decode) on NVIDIA.

q_nope is absorbed through W_UK and the latent output projected through W_UV with the invariant
batched GEMM (gemm.bmm); in between, mla_kernels' attention over the paged latent cache with a
FIXED split size (SPLIT entries, not a fixed number of splits), folded in split order. Each token's
reduction depends only on its position, so its bits are the same alone or in a batch, in one prefill
chunk or many, or as a decode step. Prefill uses the absorbed form too (more FLOPs than the default
path's up-projected MHA, but one reduction order shared with decode).

The schedule (one-stage: a program folds its splits in turn; two-stage: a program per split, the last
of a q-block's splits folding them) gives the same bits either way, so it is picked from host-known sizes for speed: two
stages where a small decode batch leaves the GPU idle, one otherwise. A decode-only batch needs no
q-block tables (the kernels' DECODE mode reads seq_lens alone: no host sync, no extra launches), so it is
captured in CUDA graphs; a padded graph row (sequence length 0) attends nothing and its output rows are
left unwritten (no row reads another's). The model's entry, forward_from_latent, runs the latent norm,
RoPE and KV write as mla_prep's one per-token launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

from deepinfer.backend import MLAAttentionOp, MLASpec
from deepinfer.backends.nvidia.invariant.counters import COUNTERS, tile_counters
from deepinfer.backends.nvidia.invariant.gemm import bmm, interpreting
from deepinfer.backends.nvidia.invariant.mla_kernels import _mla_onestage_kernel, _mla_split_kernel
from deepinfer.backends.nvidia.invariant.tile_choice import check_gemm, check_mla, mla_tiles
from deepinfer.backends.nvidia.kv_write import kv_cache_write_parts
from deepinfer.backends.nvidia.mla_prep import mla_prep
from deepinfer.errors import BackendError

if TYPE_CHECKING:
    from deepinfer.backend import ForwardBatch

_LOG2E = 1.4426950408889634
SPLIT = 128  # cache entries per split, for every token and batch (the fixed split size)
BLOCK_N = 32  # entries per tile inside a split (SPLIT is a multiple)
BLOCK_Q = 1  # query tokens per program tile: a decode row fills the tile (16 heads), no wasted MMA rows
BLOCK_H = 16  # heads per program tile (tl.dot needs >= 16 rows)
NUM_WARPS = 4
# the softmax's row sums are MMAs (mla_kernels._split_state), so the q-block and warps may follow the batch
# (tile_choice.py); tl.sum's order follows the register layout (False: the probe's and tests' comparison)
ROWSUM_MMA = True
NUM_STAGES = 3  # software pipelining only: the same arithmetic at any depth
TWO_STAGE_MAX_PROGRAMS = 132  # below one program per SM the split-parallel schedule pays
PARTIAL_BYTES_MAX = 256 << 20  # the two-stage schedule's fp32 split states stay under this
# tokens per W_UK absorb tile in mla_prep, fixed for every batch (the default op's 16 made a prefill of 8k
# tokens 16 x 4 x 512 small programs: 7.5 ms a step against 2.1 without the absorb, H200 2026-12-03); a decode
# row launches as many absorb programs either way (heads x column blocks)
ABSORB_BLOCK_T = 64


def _tiles(num_heads: int) -> tuple[int, int, int, int, int]:
    """(SPLIT, BLOCK_N, BLOCK_Q, BLOCK_H, num_warps): fixed per model, never from the batch."""
    if interpreting():
        return 16, 8, 1, min(16, triton.next_power_of_2(num_heads)), 4
    return SPLIT, BLOCK_N, BLOCK_Q, BLOCK_H, NUM_WARPS


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, qblocks: tuple[torch.Tensor, ...] | None, scale: float,
                  two_stage: bool | None = None, block_q: int | None = None, num_warps: int | None = None,
                  rowsum_mma: bool | None = None, split_warps: int | None = None,
                  num_stages: int | None = None) -> torch.Tensor:
    """Absorbed attention: q_lat [T, H, L], q_pe [T, H, R] (any row strides) over kv_cache [blocks, page, L+R].

    The q-blocks (qb_tok / qb_len / qb_req / qb_pos, int32 [NQB]) each name up to BLOCK_Q consecutive token
    rows of one request, the first at position qb_pos. None: a decode-only batch (row b is request b's last
    token; the kernels read seq_lens alone, so the step builds no tables: no launches, graph-capturable).
    Returns [T, H, L] in q_lat's dtype. two_stage: None picks the faster schedule; True / False force one (the
    tests check both agree). block_q / num_warps: the q-block tokens and warps (None: the fixed ones);
    rowsum_mma: how the softmax sums its rows (None: ROWSUM_MMA); split_warps: the warps when the split schedule
    runs (None: num_warps); num_stages: software pipelining depth (None: NUM_STAGES; never the arithmetic).
    Probes and tile_choice set them. A row's bits always follow the row-sum method, and they follow the block
    and warps too unless the sums are MMAs.
    """
    T, H, L = q_lat.shape
    R = q_pe.shape[-1]
    split, block_n, default_q, block_h, warps = _tiles(H)
    block_q = block_q or default_q
    warps = num_warps or warps
    rowsum_mma = ROWSUM_MMA if rowsum_mma is None else rowsum_mma
    if L & (L - 1) or L < 16:
        raise BackendError(f"invariant MLA: kv_lora_rank {L} must be a power of two >= 16")
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        raise BackendError("invariant MLA: q_lat / q_pe need contiguous rows and the cache [blocks, page, L + R]")
    out = torch.empty((T, H, L), dtype=q_lat.dtype, device=q_lat.device)
    decode = qblocks is None
    if decode and block_q != 1:
        raise BackendError(f"invariant MLA: the decode q-blocks are one token each, BLOCK_Q is {block_q}")
    if decode and (block_table.shape[0] != T or seq_lens.shape[0] != T):
        raise BackendError(f"invariant MLA decode: {T} rows, {block_table.shape[0]} tables, {seq_lens.shape[0]} lengths")
    qb_tok, qb_len, qb_req, qb_pos = (seq_lens,) * 4 if decode else qblocks
    nqb = T if decode else qb_tok.shape[0]
    if T == 0 or nqb == 0:
        return out
    hb = triton.cdiv(H, block_h)
    page = kv_cache.shape[1]
    num_splits = triton.cdiv(block_table.shape[1] * page, split)  # host-known: graph-safe
    bm = block_q * block_h
    if two_stage is None:
        two_stage = (num_splits > 1 and nqb * hb < TWO_STAGE_MAX_PROGRAMS
                     and nqb * hb * num_splits * bm * (L + 2) * 4 <= PARTIAL_BYTES_MAX)
    if two_stage and nqb * hb > COUNTERS:
        raise BackendError(f"invariant MLA: the two-stage schedule takes at most {COUNTERS} q-blocks x head blocks")
    upcast = interpreting()  # gemm.mma's INTERP: fp64 products under the interpreter
    prec = "ieee" if q_lat.dtype == torch.float32 else None
    meta = dict(L=L, R=R, BLOCK_R=max(16, triton.next_power_of_2(R)),  # tl.dot: K >= 16
                PAGE=page, SPLIT=split, BLOCK_Q=block_q,
                BLOCK_H=block_h, BLOCK_N=block_n, UPCAST=upcast, PREC=prec, num_warps=warps,
                num_stages=1 if interpreting() else (num_stages or NUM_STAGES),
                DECODE=decode, ROWSUM_MMA=rowsum_mma,
                enable_fp_fusion=False)  # the two schedules must round every multiply-add alike
    scale_log2 = scale * _LOG2E
    qargs = (q_lat, q_pe, kv_cache, block_table, qb_tok, qb_len, qb_req, qb_pos, seq_lens)
    strides = (q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), block_table.stride(0))
    if two_stage and split_warps:
        meta["num_warps"] = split_warps
    if not two_stage:
        _mla_onestage_kernel[(nqb, hb)](*qargs, out, H, *strides, out.stride(0), out.stride(1), scale_log2, **meta)
        return out
    part_m = torch.empty((nqb, hb, num_splits, bm), dtype=torch.float32, device=q_lat.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((nqb, hb, num_splits, bm, L), dtype=torch.float32, device=q_lat.device)
    cnt = tile_counters(q_lat.device, nqb * hb)
    _mla_split_kernel[(nqb, hb, num_splits)](*qargs, part_m, part_l, part_acc, cnt, out, H, *strides,
                                             out.stride(0), out.stride(1), scale_log2, **meta)
    return out


def qblocks_host(query_lens: list[int], context_lens: list[int], device: torch.device,
                 block_q: int) -> tuple[torch.Tensor, ...]:
    """(qb_tok, qb_len, qb_req, qb_pos) int32 for these requests, BLOCK_Q query tokens per block: block j of
    request i starts at its token j * BLOCK_Q. Vectorised (a prefill of 8k tokens is 8k one-token blocks)."""
    n = torch.tensor(query_lens, dtype=torch.int64)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    start = torch.cumsum(n, 0) - n
    nb = (n + block_q - 1) // block_q
    req = torch.repeat_interleave(torch.arange(n.shape[0]), nb)
    first = torch.cumsum(nb, 0) - nb
    j = (torch.arange(req.shape[0]) - first[req]) * block_q
    t = torch.stack([start[req] + j, torch.clamp(n[req] - j, max=block_q), req, ctx[req] + j]).to(torch.int32)
    t = t.to(device, non_blocking=True)
    return t[0], t[1], t[2], t[3]


def _probe_prefill(spec: MLASpec, device: torch.device, dtype: torch.dtype, block_q: int | None, warps: int,
                   two_stage: bool) -> torch.Tensor:
    """The attention over a fixed random prefill of two requests (200 and 333 tokens: splits and a ragged last
    q-block) with `block_q` tokens and `warps` warps a program; block_q None: the requests' last rows as a decode
    step instead (the split schedule if two_stage). tile_choice.check_mla's probe."""
    H, L, R, page, lens = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, 64, (200, 333)
    g = torch.Generator(device=device).manual_seed(0)
    per = triton.cdiv(max(lens), page)
    cache = torch.randn(len(lens) * per, page, L + R, device=device, generator=g).to(dtype)
    table = torch.arange(len(lens) * per, device=device, dtype=torch.int32).view(len(lens), per)
    seq = torch.tensor(lens, device=device, dtype=torch.int32)
    q = (torch.randn(sum(lens), H, L, device=device, generator=g) * 0.05).to(dtype)
    qpe = (torch.randn(sum(lens), H, R, device=device, generator=g) * 0.05).to(dtype)
    if block_q is None:
        last = torch.tensor([lens[0] - 1, sum(lens) - 1], device=device)
        return mla_attention(q[last].contiguous(), qpe[last].contiguous(), cache, table, seq, None,
                             spec.softmax_scale, two_stage=two_stage, num_warps=warps)
    qb = qblocks_host(list(lens), [0] * len(lens), device, block_q)
    return mla_attention(q, qpe, cache, table, seq, qb, spec.softmax_scale, two_stage=two_stage, block_q=block_q,
                         num_warps=warps)


def _check_lengths(batch: ForwardBatch) -> bool:
    for i, (n, ctx, sl) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu, batch.seq_lens_cpu)):
        if sl != ctx + n:
            raise BackendError(f"MLA: request {i} has seq_len {sl} != context_len {ctx} + query_len {n}")
    return True


class InvariantMLAAttention(MLAAttentionOp):
    """The nvidia backend's MLA under batch invariance (see the module docstring)."""

    two_stage: bool | None = None  # None: the faster schedule; tests force each (same bits)
    _tiles_key: tuple = ()  # (heads, kv_lora_rank, rope dim, dtype): tile_choice's key (set at load)

    def __init__(self, spec: MLASpec):
        super().__init__(spec)
        self.w_uk: torch.Tensor | None = None  # [H, nope, L]
        self.w_uv_t: torch.Tensor | None = None  # [H, L, v] (a transposed view of W_UV [H, v, L])

    def load_kv_b_proj(self, weight: torch.Tensor) -> None:
        w_uk, w_uv = self.split_kv_b_proj(weight)
        self.w_uk = w_uk.contiguous()
        self.w_uv_t = w_uv.contiguous().transpose(1, 2)
        tile_counters(weight.device, 0)  # at load, never first inside a graph capture
        check_gemm(self.w_uk)  # their large tiles for prefill, where this device keeps the bits (tile_choice.py)
        check_gemm(self.w_uv_t)
        s = self.spec
        self._tiles_key = (s.num_heads, s.kv_lora_rank, s.qk_rope_head_dim, weight.dtype)
        check_mla(self._tiles_key, lambda bq, w, two: _probe_prefill(s, weight.device, weight.dtype, bq, w, two),
                  weight.device)

    def forward(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                batch: ForwardBatch, group: str) -> torch.Tensor:
        self._check(q, kv_cache, batch)
        kv_cache_write_parts(kv_cache, batch.slot_mapping[group], kv_c.contiguous(), k_pe.contiguous())
        return self._attend(q, kv_cache, batch, group)

    def forward_from_latent(self, q, kv_a, kv_norm_weight, eps, positions, rope_cache, interleaved, kv_cache,
                            batch, group, ops) -> torch.Tensor:
        """kv_a RMSNorm, RoPE (q_pe rotated in place), the KV write and the W_UK absorb in one launch (mla_prep),
        then the attention: one launch where the default composition makes seven (norm, two copies, RoPE, cat,
        write, absorb GEMM).

        mla_prep is row-invariant (one program per token, the norm's sum over the row in one program; the absorb
        one fixed-shape tl.dot per 16-token tile, a row's products independent of its tile-mates) and runs for
        every batch the same way. The default op absorbs in mla_prep for decode-only batches only; here prefill
        rows take it too (the default prefill up-projects instead), so decode and prefill rows get the same bits."""
        self._check(q, kv_cache, batch)
        q_lat = mla_prep(q, kv_a, kv_norm_weight, eps, positions, rope_cache, interleaved, kv_cache,
                         batch.slot_mapping[group], w_uk=self.w_uk.to(q.dtype), absorb_block_t=ABSORB_BLOCK_T)
        return self._attend(q, kv_cache, batch, group, q_lat)

    def _check(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch) -> None:
        self.check_inputs(q, kv_cache, self.w_uk is not None)
        if sum(batch.query_lens_cpu) != q.shape[0]:
            raise BackendError(f"MLA: batch query_lens_cpu sum to {sum(batch.query_lens_cpu)}, q has {q.shape[0]} rows")

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, group: str,
                q_lat: torch.Tensor | None = None) -> torch.Tensor:
        """W_UK absorb (unless q_lat is given), the attention over the cache (which holds this step's entries),
        W_UV: all invariant."""
        s = self.spec
        T, H = q.shape[0], s.num_heads
        w_uv_t = self.w_uv_t.to(q.dtype)  # a no-op in the load dtype
        if q_lat is None:
            q_lat = torch.empty((T, H, s.kv_lora_rank), dtype=q.dtype, device=q.device)
            bmm(q[..., : s.qk_nope_head_dim].transpose(0, 1), self.w_uk.to(q.dtype), out=q_lat.transpose(0, 1))
        qb = None  # decode-only: the kernels read seq_lens alone
        tiles = mla_tiles(self._tiles_key)  # checked at load, or None: the fixed tile everywhere
        bq, warps = (None, None) if tiles is None else tiles[0]
        if not batch.is_decode_only:
            batch.memo("mla_lengths_checked", lambda: _check_lengths(batch))
            bq = bq or _tiles(H)[2]
            qb = batch.memo(("invariant_mla_qblocks", bq), lambda: qblocks_host(
                batch.query_lens_cpu, batch.context_lens_cpu, q.device, bq))
        lat = mla_attention(q_lat, q[..., s.qk_nope_head_dim:], kv_cache, batch.block_tables[group],
                            batch.seq_lens, qb, s.softmax_scale, two_stage=self.two_stage,
                            block_q=None if qb is None else bq, num_warps=None if qb is None else warps,
                            split_warps=None if tiles is None else tiles[1])
        out = torch.empty((T, H, s.v_head_dim), dtype=q.dtype, device=q.device)
        bmm(lat.transpose(0, 1), w_uv_t, out=out.transpose(0, 1))
        return out.view(T, H * s.v_head_dim)
