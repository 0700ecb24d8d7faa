"""The MLA prolog and the paged KV scatter, emulated from their docs (Ascend/op-plugin master @517f2e7):

- npu_mla_prolog_v3 (torch_npu-npu_mla_prolog_v3.md), the non-quantised scenario only (weight_quant_mode 0,
  kv_cache_quant_mode 0, query_quant_mode 0): c^Q = RmsNorm(x W^DQ); q^C = c^Q W^UQ (per head D nope | Dr rope
  columns); q^N = q^C_nope W^UK; q^R = ROPE(q^C_rope); c^KV = RmsNorm(x W^DKV) and k^R = ROPE(x W^KR) written to
  the caches. ROPE is the documented "interleave-half" mode: evens then odds of the input, then rotate-half.
  Matmuls and norms in fp32; rounded to bf16 where the formulas name a result (c^Q, q^C, q^N, q^R, c^KV, k^R):
  where the real kernel rounds is not documented. cache_mode "PA_BSND" (paged, at cache_index) and "TND" (one
  row per token, no index). The shape limits are the master docs' table.
- npu_scatter_pa_kv_cache, cache_mode "Norm" (ND) with 3-D key / value: scenario 2 of the 7.2.0 docs
  (key [T, N, Dk], value [T, N, Dv], key_cache [nb, bs, N, Dk], value_cache [nb, bs, N, Dv], slot_mapping [T]).
- npu_format_cast(x, 29): FRACTAL_NZ is an internal storage layout; CPU tensors have one layout, so the fake
  returns a contiguous copy with the same logical shape (what aten ops see of an NZ tensor on the NPU).
"""

from __future__ import annotations

import torch

from torch_npu._attention_ops import _deinterleave, _rotate_half
from torch_npu._checks import dims, dtype_in, unused

BF16 = (torch.bfloat16,)
HE = (1024, 2048, 3072, 4096, 5120, 6144, 7168, 7680, 8192)
HCQ = (1536, 2048)
HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ = 2, 29


def npu_format_cast(x: torch.Tensor, acl_format: int) -> torch.Tensor:
    if acl_format not in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ):
        raise NotImplementedError(f"fake torch_npu: acl_format {acl_format} is not emulated (ND 2, FRACTAL_NZ 29)")
    return x.clone(memory_format=torch.contiguous_format)


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """interleave-half: [x[::2] | x[1::2]] * cos + [-x[1::2] | x[::2]] * sin (cos / sin broadcast over heads)."""
    q = _deinterleave(x)
    return q * cos + _rotate_half(q) * sin


def _contiguous(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"npu_mla_prolog_v3: {name} must be contiguous")


def npu_mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                      rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, cache_index=None,
                      dequant_scale_x=None, dequant_scale_w_dq=None, dequant_scale_w_uq_qr=None,
                      dequant_scale_w_dkv_kr=None, quant_scale_ckv=None, quant_scale_ckr=None, smooth_scales_cq=None,
                      actual_seq_len=None, k_nope_clip_alpha=None, rmsnorm_epsilon_cq=1e-05,
                      rmsnorm_epsilon_ckv=1e-05, cache_mode="PA_BSND", query_norm_flag=False, weight_quant_mode=0,
                      kv_cache_quant_mode=0, query_quant_mode=0, ckvkr_repo_mode=0, quant_scale_repo_mode=0,
                      tile_size=128, qc_qr_scale=1.0, kc_scale=1.0, token_x_dtype=None, weight_dq_dtype=None,
                      weight_uq_qr_dtype=None, weight_dkv_kr_dtype=None, kv_cache_dtype=None):
    """(query_out [T, N, 512], query_rope_out [T, N, 64], dequant_scale_q_nope, query_norm, dequant_scale_q_norm);
    the last three are empty (null in the non-quantised scenario). kv_cache / kr_cache are updated in place."""
    unused(dequant_scale_x=dequant_scale_x, dequant_scale_w_dq=dequant_scale_w_dq,
           dequant_scale_w_uq_qr=dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr=dequant_scale_w_dkv_kr,
           quant_scale_ckv=quant_scale_ckv, quant_scale_ckr=quant_scale_ckr, smooth_scales_cq=smooth_scales_cq,
           actual_seq_len=actual_seq_len, k_nope_clip_alpha=k_nope_clip_alpha, query_norm_flag=query_norm_flag,
           token_x_dtype=token_x_dtype, weight_dq_dtype=weight_dq_dtype, weight_uq_qr_dtype=weight_uq_qr_dtype,
           weight_dkv_kr_dtype=weight_dkv_kr_dtype, kv_cache_dtype=kv_cache_dtype)
    modes = (weight_quant_mode, kv_cache_quant_mode, query_quant_mode, ckvkr_repo_mode, quant_scale_repo_mode)
    if any(modes) or qc_qr_scale != 1.0 or kc_scale != 1.0:
        raise NotImplementedError("fake torch_npu: only the non-quantised npu_mla_prolog_v3 scenario is emulated")
    dims("token_x", token_x, 2)  # BS merged: [T, He] (the [B, S, He] form is not emulated)
    for name, t in (("token_x", token_x), ("weight_dq", weight_dq), ("weight_uq_qr", weight_uq_qr),
                    ("weight_uk", weight_uk), ("weight_dkv_kr", weight_dkv_kr), ("rmsnorm_gamma_cq", rmsnorm_gamma_cq),
                    ("rmsnorm_gamma_ckv", rmsnorm_gamma_ckv), ("rope_sin", rope_sin), ("rope_cos", rope_cos),
                    ("kv_cache", kv_cache), ("kr_cache", kr_cache)):
        dtype_in(name, t, BF16)
    _contiguous(token_x=token_x, weight_dq=weight_dq, weight_uq_qr=weight_uq_qr, weight_uk=weight_uk,
                weight_dkv_kr=weight_dkv_kr, rope_sin=rope_sin, rope_cos=rope_cos, kv_cache=kv_cache,
                kr_cache=kr_cache, cache_index=cache_index)
    t, he = token_x.shape
    hcq = weight_dq.shape[1]
    n, d, hckv = weight_uk.shape
    dr = weight_uq_qr.shape[1] // max(n, 1) - d
    if he not in HE or hcq not in HCQ or n not in HEADS or hckv != 512 or d not in (128, 192) or dr != 64:
        raise ValueError(f"npu_mla_prolog_v3: He {he}, Hcq {hcq}, N {n}, D {d}, Dr {dr}, Hckv {hckv} outside the "
                         f"documented values (He {HE}, Hcq {HCQ}, N {HEADS}, D 128 / 192, Dr 64, Hckv 512)")
    if tuple(weight_dq.shape) != (he, hcq) or tuple(weight_uq_qr.shape) != (hcq, n * (d + dr)) or \
            tuple(weight_dkv_kr.shape) != (he, hckv + dr):
        raise ValueError("npu_mla_prolog_v3: weights must be [He, Hcq], [Hcq, N*(D+Dr)], [N, D, Hckv], [He, Hckv+Dr]")
    if tuple(rmsnorm_gamma_cq.shape) != (hcq,) or tuple(rmsnorm_gamma_ckv.shape) != (hckv,):
        raise ValueError("npu_mla_prolog_v3: rmsnorm_gamma_cq [Hcq], rmsnorm_gamma_ckv [Hckv]")
    if tuple(rope_sin.shape) != (t, dr) or rope_cos.shape != rope_sin.shape:
        raise ValueError("npu_mla_prolog_v3: rope_sin / rope_cos must be [T, Dr] with BS merged")
    if cache_mode == "PA_BSND":
        nb, bs = kv_cache.shape[:2]
        if tuple(kv_cache.shape) != (nb, bs, 1, hckv) or tuple(kr_cache.shape) != (nb, bs, 1, dr):
            raise ValueError("npu_mla_prolog_v3 PA_BSND: kv_cache [BlockNum, BlockSize, 1, 512], kr_cache [.., 1, 64]")
        if bs % 16 or not 16 <= bs <= 1024:
            raise ValueError(f"npu_mla_prolog_v3: BlockSize {bs} must be a multiple of 16 in 16..1024")
        if cache_index is None or cache_index.dtype != torch.int64 or tuple(cache_index.shape) != (t,):
            raise ValueError("npu_mla_prolog_v3 PA_BSND: cache_index int64 [T]")
        slots = cache_index
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= nb * bs):
            raise ValueError("npu_mla_prolog_v3: cache_index outside [0, BlockNum*BlockSize) (not validated by the op)")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("npu_mla_prolog_v3: repeated cache_index values write one slot twice (undefined)")
    elif cache_mode == "TND":
        if tuple(kv_cache.shape) != (t, 1, hckv) or tuple(kr_cache.shape) != (t, 1, dr) or cache_index is not None:
            raise ValueError("npu_mla_prolog_v3 TND: kv_cache [T, 1, 512], kr_cache [T, 1, 64], no cache_index")
        slots = None
    else:
        raise NotImplementedError(f"fake torch_npu: cache_mode {cache_mode!r} is not emulated (PA_BSND, TND)")
    bf, x = torch.bfloat16, token_x.float()
    cos, sin = rope_cos.float(), rope_sin.float()
    c_q = _rms(x @ weight_dq.float(), rmsnorm_gamma_cq, rmsnorm_epsilon_cq).to(bf)
    q_c = (c_q.float() @ weight_uq_qr.float()).to(bf).view(t, n, d + dr)
    q_n = torch.einsum("tnd,ndl->tnl", q_c[..., :d].float(), weight_uk.float()).to(bf)
    q_r = _rope(q_c[..., d:].float(), cos[:, None], sin[:, None]).to(bf)
    kv = x @ weight_dkv_kr.float()
    c_kv = _rms(kv[:, :hckv], rmsnorm_gamma_ckv, rmsnorm_epsilon_ckv).to(bf)
    k_r = _rope(kv[:, hckv:], cos, sin).to(bf)
    if slots is None:
        kv_cache.copy_(c_kv.view(t, 1, hckv))
        kr_cache.copy_(k_r.view(t, 1, dr))
    else:
        kv_cache.view(-1, hckv)[slots] = c_kv
        kr_cache.view(-1, dr)[slots] = k_r
    empty = torch.empty(0, dtype=torch.float32)
    return q_n, q_r, empty, empty, empty


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ") -> None:
    """key_cache.view(nb * bs, N, Dk)[slot] = key[t] (and value likewise), in place; returns nothing."""
    unused(compress_lens=compress_lens, compress_seq_offsets=compress_seq_offsets, seq_lens=seq_lens)
    if cache_mode not in ("Norm", None):
        raise NotImplementedError(f"fake torch_npu: cache_mode {cache_mode!r} is not emulated (only the ND 'Norm')")
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                         ("slot_mapping", slot_mapping)):
        if not tensor.is_contiguous():
            raise ValueError(f"npu_scatter_pa_kv_cache: {name} must be contiguous")
    dims("key", key, 3)
    dims("value", value, 3)
    if len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        raise TypeError("npu_scatter_pa_kv_cache: key, value and both caches must share one dtype")
    t, n = key.shape[:2]
    nb, bs = key_cache.shape[:2]
    if tuple(value.shape[:2]) != (t, n) or tuple(key_cache.shape) != (nb, bs, n, key.shape[2]) or \
            tuple(value_cache.shape) != (nb, bs, n, value.shape[2]):
        raise ValueError("npu_scatter_pa_kv_cache ND: key [T, N, Dk], value [T, N, Dv], caches [nb, bs, N, Dk / Dv]")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or tuple(slot_mapping.shape) != (t,):
        raise ValueError("npu_scatter_pa_kv_cache: slot_mapping int32 / int64 [T]")
    slots = slot_mapping.long()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) > nb * bs - 1):
        raise ValueError("npu_scatter_pa_kv_cache: slot_mapping outside [0, num_blocks * block_size - 1]")
    if torch.unique(slots).numel() != slots.numel():
        raise ValueError("npu_scatter_pa_kv_cache: repeated slots (correctness not guaranteed by the docs)")
    key_cache.view(nb * bs, n, -1)[slots] = key
    value_cache.view(nb * bs, n, -1)[slots] = value
