"""The MLA prolog on torch_npu.npu_mla_prolog_v3: hidden states -> absorbed latent q (q^N = q_nope W_UK), q_pe
after RoPE, and the normed latent + rotated k_pe written to the split cache, in one operator.

Written against op-plugin's torch_npu-npu_mla_prolog_v3.md (master @517f2e7), non-quantised scenario
(weight_quant_mode / kv_cache_quant_mode / query_quant_mode 0, every input bf16):
- weights: weight_dq = q_a^T [He, Hcq], weight_uq_qr = q_b^T [Hcq, N*(D+Dr)] (q_b's own per-head nope | rope
  order), weight_dkv_kr = kv_a^T [He, Hckv+Dr], all three cast to FRACTAL_NZ (npu_format_cast(w, 29), as the
  docs' example); weight_uk = W_UK [N, D, Hckv] in ND.
- RoPE: the documented "interleave-half" mode (evens then odds of the input, then rotate-half), i.e. the
  interleaved RoPE of V2 / V3 whose output lands in the [evens | odds] order this backend stores k_pe in
  (ROPE_ORDER); cos / sin [T, 64] are the 32 angles twice, in bf16.
- cache_mode "PA_BSND": kv_cache [nb, bs, 1, 512], kr_cache [nb, bs, 1, 64] written at cache_index (int64 [T],
  which the op does not validate: only used when every slot is real); "TND": the two outputs for each token
  into [T, 1, 512] / [T, 1, 64] buffers, which the MLA op then writes with its graph-safe write (inside a
  capture, or with padded rows carrying slot -1).
Shape limits: the op-plugin 26.0.0 table (He 7168 / 7680, Hcq 1536, D 128, N a power of two up to 128, Hckv 512,
Dr 64, BlockSize a multiple of 16 up to 1024), the narrower of the releases we read (master's allows He
1024..8192, Hcq 2048, D 192); we cannot tell the releases apart from torch_npu's version, so the op is used
only if the installed torch_npu has it, within those limits: DeepSeek-V3 / R1 (He 7168, Hcq 1536) fit, V2
(He 5120) and V2-Lite (no q_lora_rank) do not. Never run on an NPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer.backend import MLAPrologWeights, MLASpec

PROLOG_HIDDEN = (7168, 7680)  # op-plugin 26.0.0 docs (master: 1024 ... 8192)
PROLOG_Q_LORA = (1536,)  # 26.0.0 docs (master: 1536, 2048)
ACL_FORMAT_FRACTAL_NZ = 29


def prolog_reasons(spec: MLASpec, hidden: int, q_lora_rank: int, dtype: torch.dtype, npu: ModuleType) -> list[str]:
    """Why npu_mla_prolog_v3 cannot take this layer (the MLA op itself already has the fused attention's widths:
    kv_lora_rank 512, rope 64, nope / v 128, a power-of-two head count)."""
    why = []
    if not hasattr(npu, "npu_mla_prolog_v3"):
        why.append("this torch_npu has no npu_mla_prolog_v3 (op-plugin 7.3.0 beta / 26.0.0 and later)")
    if dtype != torch.bfloat16:
        why.append(f"npu_mla_prolog_v3 takes bf16 only (not {dtype})")
    if hidden not in PROLOG_HIDDEN:
        why.append(f"hidden size {hidden} is not one of {PROLOG_HIDDEN}")
    if q_lora_rank not in PROLOG_Q_LORA:
        why.append(f"q_lora_rank {q_lora_rank} is not one of {PROLOG_Q_LORA}")
    return why


@dataclass(frozen=True)
class PrologTensors:
    """The weights as npu_mla_prolog_v3 takes them (prepared once, at load)."""

    weight_dq: torch.Tensor
    weight_uq_qr: torch.Tensor
    weight_dkv_kr: torch.Tensor
    gamma_cq: torch.Tensor
    gamma_ckv: torch.Tensor
    eps: float


def prepare(npu: ModuleType, w: MLAPrologWeights) -> PrologTensors:
    def nz(t: torch.Tensor) -> torch.Tensor:
        return npu.npu_format_cast(t.t().contiguous(), ACL_FORMAT_FRACTAL_NZ)

    return PrologTensors(nz(w.q_a), nz(w.q_b), nz(w.kv_a), w.q_a_norm.contiguous(), w.kv_a_norm.contiguous(), w.eps)


def run_prolog(npu: ModuleType, p: PrologTensors, w_uk: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, slots: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(q_lat [T, N, 512], q_pe [T, N, 64] stored order, kv_c, k_pe). slots given: written into the paged caches
    (PA_BSND) and kv_c / k_pe are None; slots None: TND, kv_c [T, 512] / k_pe [T, 64] (stored order) returned
    for the caller to write."""
    t = x.shape[0]
    if slots is not None:
        nb, bs = latent.shape[:2]
        kv_cache, kr_cache = latent.view(nb, bs, 1, 512), rope.view(nb, bs, 1, 64)
        mode, index = "PA_BSND", slots.to(torch.int64).contiguous()
    else:
        kv_cache = torch.empty((t, 1, 512), dtype=x.dtype, device=x.device)
        kr_cache = torch.empty((t, 1, 64), dtype=x.dtype, device=x.device)
        mode, index = "TND", None
    q_lat, q_pe, _, _, _ = npu.npu_mla_prolog_v3(
        x.contiguous(), p.weight_dq, p.weight_uq_qr, w_uk, p.weight_dkv_kr, p.gamma_cq, p.gamma_ckv,
        sin.contiguous(), cos.contiguous(), kv_cache, kr_cache, cache_index=index, rmsnorm_epsilon_cq=p.eps,
        rmsnorm_epsilon_ckv=p.eps, cache_mode=mode)
    if slots is not None:
        return q_lat, q_pe, None, None
    return q_lat, q_pe, kv_cache.view(t, 512), kr_cache.view(t, 64)
