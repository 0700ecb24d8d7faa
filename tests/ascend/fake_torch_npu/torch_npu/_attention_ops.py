"""MLA operators: the fused KV norm + RoPE + paged-cache write, the interleaved RoPE, and
npu_fused_infer_attention_score in the two MLA modes the backend uses:

- paged absorbed decode: input_layout "BSND", query [B, 1, N, 512] + query_rope [B, 1, N, 64], key = value
  = the latent cache [num_blocks, block_size, 512] (BnBsH, KV_N 1) + key_rope [num_blocks, block_size, 64],
  block_table, block_size, actual_seq_lengths_kv (per batch), sparse_mode 0;
- prefill over gathered context: input_layout "TND", q / k / v D 128 + rope 64, actual_seq_lengths and
  actual_seq_lengths_kv as cumulative sums, sparse_mode 3 (rightDownCausal, the 2048 x 2048 mask).
Scores and softmax in fp32; the output rounded to the query's dtype.
"""

from __future__ import annotations

import torch

from torch_npu._checks import HALF, dims, dtype_in, unused

MLA_Q_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., D] pairs (2i, 2i+1) -> [all even | all odd] (the reshape + transpose of the docs)."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def npu_interleave_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, S, 64] interleaved -> de-interleaved q, then q * cos + rotate_half(q) * sin (cos/sin N = 1)."""
    dims("x", x, 4)
    dtype_in("x", x, HALF)
    if x.shape[-1] != 64 or cos.shape[-1] != 64 or cos.shape[1] != 1 or cos.shape != sin.shape:
        raise ValueError("npu_interleave_rope: D must be 64 and cos/sin [B, 1, S or 1, 64]")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise TypeError("npu_interleave_rope: cos/sin must have x's dtype")
    q = _deinterleave(x.float())
    return (q * cos.float() + _rotate_half(q) * sin.float()).to(x.dtype)


def npu_kv_rmsnorm_rope_cache(kv: torch.Tensor, gamma: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              index: torch.Tensor, k_cache: torch.Tensor, ckv_cache: torch.Tensor, *,
                              k_rope_scale=None, c_kv_scale=None, k_rope_offset=None, c_kv_offset=None,
                              epsilon: float = 1e-5, cache_mode: str = "Norm", is_output_kv: bool = False):
    """cache_mode "PA": kv [B, 1, S, 576] = latent 512 | rope 64; the latent is RMS-normed (times gamma), the
    rope part rotated as npu_interleave_rope; both scattered at the global offsets `index` [B*S] into
    ckv_cache [nb, bs, 1, 512] / k_cache [nb, bs, 1, 64] in place. Returns (k_cache, ckv_cache, k_embed, y)."""
    unused(k_rope_scale=k_rope_scale, c_kv_scale=c_kv_scale, k_rope_offset=k_rope_offset, c_kv_offset=c_kv_offset)
    if cache_mode != "PA":
        raise NotImplementedError(f"fake torch_npu: cache_mode {cache_mode!r} is not emulated (only 'PA')")
    dims("kv", kv, 4)
    dtype_in("kv", kv, HALF)
    b, n, s, hidden = kv.shape
    if n != 1 or hidden != 576 or tuple(gamma.shape) != (512,) or gamma.dtype != kv.dtype:
        raise ValueError("npu_kv_rmsnorm_rope_cache: kv must be [B, 1, S, 576], gamma [512] in kv's dtype")
    if tuple(cos.shape) != (b, 1, s, 64) or cos.shape != sin.shape or cos.dtype != kv.dtype:
        raise ValueError("npu_kv_rmsnorm_rope_cache: cos/sin must be [B, 1, S, 64] in kv's dtype")
    if index.dtype != torch.int64 or tuple(index.shape) != (b * s,):
        raise ValueError("npu_kv_rmsnorm_rope_cache: index must be int64 [B*S] in PA mode")
    nb, bs = ckv_cache.shape[:2]
    if tuple(ckv_cache.shape) != (nb, bs, 1, 512) or tuple(k_cache.shape) != (nb, bs, 1, 64):
        raise ValueError("npu_kv_rmsnorm_rope_cache: PA caches must be [nb, bs, 1, 512] and [nb, bs, 1, 64]")
    if ckv_cache.dtype != kv.dtype or k_cache.dtype != kv.dtype:
        raise TypeError("npu_kv_rmsnorm_rope_cache: unquantised caches must have kv's dtype")
    slots = index.long()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= nb * bs):
        raise ValueError("npu_kv_rmsnorm_rope_cache: index outside the cache (negative offsets are undocumented)")
    if torch.unique(slots).numel() != slots.numel():
        raise ValueError("npu_kv_rmsnorm_rope_cache: repeated index values are undefined behaviour")
    x = kv.float()
    lat, rope = x[..., :512], x[..., 512:]
    y = (lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.float()).to(kv.dtype)
    q = _deinterleave(rope)
    k_embed = (q * cos.float() + _rotate_half(q) * sin.float()).to(kv.dtype)
    ckv_cache.view(nb * bs, 512)[slots] = y.reshape(-1, 512)
    k_cache.view(nb * bs, 64)[slots] = k_embed.reshape(-1, 64)
    if is_output_kv:
        return k_cache, ckv_cache, k_embed, y
    return k_cache, ckv_cache, torch.empty(0), torch.empty(0)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int | None) -> torch.Tensor:
    """q [Sq, N, D], k [Sk, N|1, D], v [Sk, N|1, Dv] fp32; causal aligned bottom-right when offset is set."""
    scores = torch.einsum("qnd,knd->nqk", q, k.expand(-1, q.shape[1], -1)) * scale
    if offset is not None:
        qpos = torch.arange(q.shape[0])[:, None] + offset
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("nqk,knd->qnd", scores.softmax(-1), v.expand(-1, q.shape[1], -1))


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
                                    dequant_scale2=None, quant_scale2=None, quant_offset2=None,
                                    antiquant_scale=None, antiquant_offset=None, block_table=None,
                                    query_padding_size=None, kv_padding_size=None, key_antiquant_scale=None,
                                    key_antiquant_offset=None, value_antiquant_scale=None,
                                    value_antiquant_offset=None, key_shared_prefix=None, value_shared_prefix=None,
                                    actual_shared_prefix_len=None, query_rope=None, key_rope=None,
                                    key_rope_antiquant_scale=None, num_heads: int = 1, scale: float = 1.0,
                                    pre_tokens: int = 2147483647, next_tokens: int = 2147483647,
                                    input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0,
                                    inner_precise: int = 0, block_size: int = 0, antiquant_mode: int = 0,
                                    softmax_lse_flag: bool = False, key_antiquant_mode: int = 0,
                                    value_antiquant_mode: int = 0):
    """(attention_out, softmax_lse placeholder) for the two MLA modes in the module docstring."""
    unused(pse_shift=pse_shift, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
           dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
           antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset, query_padding_size=query_padding_size,
           kv_padding_size=kv_padding_size, key_antiquant_scale=key_antiquant_scale,
           key_antiquant_offset=key_antiquant_offset, value_antiquant_scale=value_antiquant_scale,
           value_antiquant_offset=value_antiquant_offset, key_shared_prefix=key_shared_prefix,
           value_shared_prefix=value_shared_prefix, actual_shared_prefix_len=actual_shared_prefix_len,
           key_rope_antiquant_scale=key_rope_antiquant_scale, softmax_lse_flag=softmax_lse_flag)
    if query_rope is None or key_rope is None:
        raise NotImplementedError("fake torch_npu: only the MLA modes (query_rope + key_rope) are emulated")
    for name, t in (("query", query), ("key", key), ("value", value), ("query_rope", query_rope),
                    ("key_rope", key_rope)):
        dtype_in(name, t, HALF)
        if t.dtype != query.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from the query's {query.dtype}")
    if query_rope.shape[-1] != 64 or key_rope.shape[-1] != 64:
        raise ValueError("MLA: query_rope / key_rope must have D = 64")
    if block_table is not None:
        out = _paged_decode(query, key, query_rope, key_rope, block_table, block_size, actual_seq_lengths_kv,
                            num_heads, num_key_value_heads, scale, input_layout, sparse_mode)
    else:
        out = _tnd_prefill(query, key, value, query_rope, key_rope, atten_mask, actual_seq_lengths,
                           actual_seq_lengths_kv, num_heads, num_key_value_heads, scale, input_layout, sparse_mode)
    return out, torch.empty(0, dtype=torch.float32)


def _paged_decode(query, key, query_rope, key_rope, block_table, block_size, seq_kv, num_heads, num_kv_heads, scale,
                  input_layout, sparse_mode) -> torch.Tensor:
    if input_layout != "BSND" or sparse_mode != 0:
        raise NotImplementedError("fake torch_npu: paged MLA is emulated for BSND, sparse_mode 0")
    dims("query", query, 4)
    b, s, n, d = query.shape
    if s != 1 or d != 512 or n != num_heads or n not in MLA_Q_HEADS or num_kv_heads != 1:
        raise ValueError(f"MLA paged decode: query must be [B, 1, N in {MLA_Q_HEADS}, 512] with KV_N 1")
    nb, bs, h = key.shape
    if h != 512 or bs != block_size or block_size % 16 or not 0 < block_size <= 1024:
        raise ValueError("MLA paged decode: key [nb, block_size, 512] with block_size a multiple of 16 <= 1024")
    if tuple(key_rope.shape) != (nb, bs, 64) or block_table.dtype != torch.int32 or block_table.shape[0] != b:
        raise ValueError("MLA paged decode: key_rope [nb, bs, 64] and an int32 block_table [B, max_blocks]")
    if seq_kv is None or len(seq_kv) != b:
        raise ValueError("PageAttention needs actual_seq_lengths_kv with one entry per batch")
    out = torch.zeros((b, 1, n, d), dtype=torch.float32)
    for i, length in enumerate(seq_kv):
        nblk = -(-int(length) // bs)
        blocks = block_table[i, :nblk].long()
        if nblk > block_table.shape[1] or bool((blocks < 0).any()) or bool((blocks >= nb).any()):
            raise ValueError(f"MLA paged decode: block_table row {i} does not hold {length} tokens")
        if length == 0:
            continue
        lat = key[blocks].reshape(-1, 512)[:length].float()
        rope = key_rope[blocks].reshape(-1, 64)[:length].float()
        qn, qr = query[i, 0].float(), query_rope[i, 0].float()  # [N, 512], [N, 64]
        scores = (qn @ lat.T + qr @ rope.T) * scale
        out[i, 0] = scores.softmax(-1) @ lat
    return out.to(query.dtype)


def _tnd_prefill(query, key, value, query_rope, key_rope, atten_mask, seq_q, seq_kv, num_heads, num_kv_heads, scale,
                 input_layout, sparse_mode) -> torch.Tensor:
    if input_layout != "TND" or sparse_mode != 3:
        raise NotImplementedError("fake torch_npu: non-paged MLA is emulated for TND, sparse_mode 3")
    for name, t in (("query", query), ("key", key), ("value", value)):
        dims(name, t, 3)
        if t.shape[-1] != 128:
            raise ValueError("TND MLA with rope: Q_D = K_D = V_D = 128")
    n = query.shape[1]
    if n != num_heads or key.shape[1] != n or value.shape[1] != n or num_kv_heads not in (0, n):
        raise ValueError("TND MLA prefill: q / k / v must all have num_heads heads")
    if atten_mask is None or tuple(atten_mask.shape) != (2048, 2048) or atten_mask.dtype not in (torch.bool,
                                                                                                 torch.int8,
                                                                                                 torch.uint8):
        raise ValueError("sparse_mode 3 needs the optimised 2048 x 2048 causal atten_mask (bool / int8 / uint8)")
    if seq_q is None or seq_kv is None or len(seq_q) != len(seq_kv) or len(seq_q) > 4096:
        raise ValueError("TND needs actual_seq_lengths and actual_seq_lengths_kv (cumulative, one per batch)")
    if list(seq_q) != sorted(seq_q) or list(seq_kv) != sorted(seq_kv):
        raise ValueError("TND: actual_seq_lengths(_kv) must be cumulative sums")
    if seq_q[-1] != query.shape[0] or seq_kv[-1] != key.shape[0]:
        raise ValueError("TND: the last cumulative length must equal T")
    out = torch.zeros(query.shape[:2] + (value.shape[-1],), dtype=torch.float32)
    q0 = k0 = 0
    for q1, k1 in zip(seq_q, seq_kv):
        lq, lk = q1 - q0, k1 - k0
        if lq:
            q = torch.cat([query[q0:q1], query_rope[q0:q1]], -1).float()
            k = torch.cat([key[k0:k1], key_rope[k0:k1]], -1).float()
            out[q0:q1] = _attend(q, k, value[k0:k1].float(), scale, offset=lk - lq)
        q0, k0 = q1, k1
    return out.to(query.dtype)


def npu_fused_infer_attention_score_out(query, key, value, *, workspace=None, out=None, **kwargs):
    """The `.out` overload graph capture uses: the same computation written into out=[attention_out, lse]
    (the documented pair), with the workspace _npu_fused_infer_attention_score_get_max_workspace sized."""
    if workspace is None or out is None or len(out) != 2:
        raise ValueError("npu_fused_infer_attention_score.out needs workspace= and out=[attention_out, softmax_lse]")
    res, _ = npu_fused_infer_attention_score(query, key, value, **kwargs)
    if out[0].shape != res.shape or out[0].dtype != res.dtype:
        raise ValueError(f"out[0] must be {tuple(res.shape)} {res.dtype}, got {tuple(out[0].shape)} {out[0].dtype}")
    out[0].copy_(res)
    return out


def npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs) -> torch.Tensor:
    """A workspace for the largest case of these arguments (its size is the real op's business: a token here)."""
    return torch.empty(1, dtype=torch.uint8)
