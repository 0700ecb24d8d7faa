"""Write AWQ / GPTQ int4 checkpoints from a dense one, in the formats' exact packing (for tests and benchmarks).

`quantize_int4` is asymmetric round-to-nearest per (128 input channels, output channel): scale =
(max - min) / 15, zero = round(-min / scale) in [0, 15], q = clamp(round(w / scale) + zero, 0, 15),
so W ~= (q - zero) * scale. AWQ's activation-aware scaling search is not run: the packing, not the
calibration, is what a loader has to get right. Packing, from AutoAWQ's and AutoGPTQ's layouts:

- AWQ (GEMM): qweight int32 [K, N/8], qzeros int32 [G, N/8], word c's nibble slot i holding column
  8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; scales fp16 [G, N].
- GPTQ (v1): qweight int32 [K/8, N], word i's slot j holding input row 8i + j; qzeros int32 [G, N/8],
  slot j holding column 8c + j, storing zero - 1; scales fp16 [G, N]; g_idx int32 [K].

This file packs with its own loops over the nibble slots (independent of the engine's unpacking
code in deepinfer/backend/native/quant_int4.py, which the tests compare against it).
"""

from __future__ import annotations

import json
import os

import torch

GROUP = 128
_AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (a linear's [out, in]) -> (q int [K, N], zeros int [G, N], scales fp16 [G, N])."""
    n, k = w.shape
    wk = w.float().t().reshape(k // group, group, n)
    lo, hi = wk.amin(dim=1), wk.amax(dim=1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    s = scales.float()
    zeros = torch.round(-lo / s).clamp(0, 15)
    q = torch.clamp(torch.round(wk / s[:, None, :]) + zeros[:, None, :], 0, 15)
    return q.reshape(k, n).to(torch.int64), zeros.to(torch.int64), scales


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq_cols(v: torch.Tensor) -> torch.Tensor:
    """int [R, N] in 0..15 -> AWQ int32 [R, N/8]."""
    r, n = v.shape
    cols = v.view(r, n // 8, 8)
    words = torch.zeros(r, n // 8, dtype=torch.int64)
    for slot, col in enumerate(_AWQ_PACK_ORDER):
        words |= cols[:, :, col] << (4 * slot)
    return _to_int32(words)


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int [K, N], zeros int [G, N]) -> (qweight int32 [K/8, N], qzeros int32 [G, N/8] storing zero - 1)."""
    k, n = q.shape
    rows = q.view(k // 8, 8, n)
    qw = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        qw |= rows[:, j, :] << (4 * j)
    z = (zeros - 1) & 0xF
    g = z.shape[0]
    zc = z.view(g, n // 8, 8)
    qz = torch.zeros(g, n // 8, dtype=torch.int64)
    for j in range(8):
        qz |= zc[:, :, j] << (4 * j)
    return _to_int32(qw), _to_int32(qz)


def int4_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """A decoder linear AutoAWQ would quantize: 2-D, K % 128 == 0, N % 8 == 0; not the router gate or the head."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2
            and not name.endswith("mlp.gate.weight") and shape[1] % GROUP == 0 and shape[0] % 8 == 0)


def write_int4_checkpoint(src: str, dst: str, method: str = "awq") -> list[str]:
    """Copy the dense checkpoint `src` (a single model.safetensors) to `dst` with every quantizable linear
    stored as AWQ / GPTQ int4; returns the prefixes quantized. config.json gets AWQ's / GPTQ's
    quantization_config; tokenizer files are copied."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    done = []
    for name, t in tensors.items():
        if not int4_quantizable(name, tuple(t.shape)):
            out[name] = t
            continue
        prefix = name[: -len(".weight")]
        q, zeros, scales = quantize_int4(t)
        if method == "awq":
            out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"] = pack_awq_cols(q), pack_awq_cols(zeros)
        else:
            out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"] = pack_gptq(q, zeros)
            out[f"{prefix}.g_idx"] = (torch.arange(t.shape[1]) // GROUP).to(torch.int32)
        out[f"{prefix}.scales"] = scales
        done.append(prefix)
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
         "checkpoint_format": "gptq"})
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    for extra in os.listdir(src):
        if extra not in ("config.json", "model.safetensors") and os.path.isfile(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), os.path.join(dst, extra))
    return done
