"""KV-cache write in Triton: scatter one entry per token into its paged slot (slot -1 skipped).

MLA's two-part write (kv_cache_write_parts) also fills an fp8 cache: each value divided by the layer's
scale, clamped to ±448 and rounded to e4m3 (kv_fp8.fp8_e4m3_value), as the torch reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.nvidia.kv_fp8 import fp8_e4m3_value


@triton.jit
def _kv_write_kernel(cache_ptr, slot_ptr, val_ptr, E, stride_v, BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < E
        v = tl.load(val_ptr + tok.to(tl.int64) * stride_v + offs, mask=mask)
        tl.store(cache_ptr + slot * E + offs, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_write2_kernel(cache_ptr, slot_ptr, a_ptr, b_ptr, EA, EB, stride_a, stride_b, kv_scale,
                      BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, FP8: tl.constexpr, SCALED: tl.constexpr):
    """Entry = [a row | b row]: MLA's kv_c and k_pe written without concatenating them first."""
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        base = cache_ptr + slot * (EA + EB)
        oa = tl.arange(0, BLOCK_A)
        va = tl.load(a_ptr + tok.to(tl.int64) * stride_a + oa, mask=oa < EA)
        ob = tl.arange(0, BLOCK_B)
        vb = tl.load(b_ptr + tok.to(tl.int64) * stride_b + ob, mask=ob < EB)
        if FP8:
            va = fp8_e4m3_value(va.to(tl.float32), kv_scale, SCALED)
            vb = fp8_e4m3_value(vb.to(tl.float32), kv_scale, SCALED)
        tl.store(base + oa, va.to(cache_ptr.dtype.element_ty), mask=oa < EA)
        tl.store(base + EA + ob, vb.to(cache_ptr.dtype.element_ty), mask=ob < EB)


def kv_cache_write_parts(cache: torch.Tensor, slot_mapping: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         kv_scale: float = 1.0) -> None:
    """kv_cache_write(cache, slots, cat([a, b], -1)) in one kernel; a [T, EA], b [T, EB]. A float8_e4m3fn
    cache stores clamp(x / kv_scale, ±448) in e4m3 (deepinfer.backend.kv_spec.quantize_kv)."""
    from deepinfer.errors import BackendError

    ea, eb = a.shape[-1], b.shape[-1]
    if cache.shape[-1] != ea + eb or cache.dim() != 3 or not cache.is_contiguous():
        raise BackendError(f"kv_cache_write_parts: cache {tuple(cache.shape)} entries are not {ea} + {eb} wide")
    if not (a.shape[0] == b.shape[0] == slot_mapping.shape[0]) or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise BackendError("kv_cache_write_parts: a, b and slot_mapping need one row per token, contiguous rows")
    if a.shape[0]:
        _kv_write2_kernel[(a.shape[0],)](
            cache, slot_mapping, a, b, ea, eb, a.stride(0), b.stride(0), float(kv_scale),
            BLOCK_A=triton.next_power_of_2(ea), BLOCK_B=triton.next_power_of_2(eb),
            FP8=cache.dtype == torch.float8_e4m3fn, SCALED=kv_scale != 1.0, num_warps=4,
        )


def kv_cache_write(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """cache.view(-1, *entry)[slot] = values[i] for every slot >= 0."""
    from deepinfer.errors import BackendError

    entry = 1
    for d in cache.shape[2:]:
        entry *= d
    v2 = values.reshape(values.shape[0], -1)
    if v2.shape[1] != entry:
        raise BackendError(f"kv_cache_write: value entry of {v2.shape[1]} elements, cache entry is {entry}")
    if slot_mapping.shape[0] != v2.shape[0]:
        raise BackendError(f"kv_cache_write: {slot_mapping.shape[0]} slots for {v2.shape[0]} values")
    if not cache.is_contiguous():
        raise BackendError("kv_cache_write: cache must be contiguous")
    if v2.stride(-1) != 1:
        v2 = v2.contiguous()
    if v2.shape[0]:
        block = min(1024, triton.next_power_of_2(entry))
        _kv_write_kernel[(v2.shape[0], triton.cdiv(entry, block))](
            cache, slot_mapping, v2, entry, v2.stride(0), BLOCK=block, num_warps=4
        )
