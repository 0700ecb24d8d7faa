"""Write AWQ / GPTQ int4 checkpoints from a dense one, in the formats' exact packing (for tests and benchmarks).

`quantize_int4` is asymmetric round-to-nearest per (128 input channels, output channel): scale =
(max - min) / 15, zero = round(-min / scale) in [0, 15], q = clamp(round(w / scale) + zero, 0, 15),
so W ~= (q - zero) * scale. AWQ's activation-aware scaling search is not run: the packing, not the
calibration, is what a loader has to get right. Packing, from AutoAWQ's and AutoGPTQ's layouts:

- AWQ (GEMM): qweight int32 [K, N/8], qzeros int32 [G, N/8], word c's nibble slot i holding column
  8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; scales fp16 [G, N].
- GPTQ (v1): qweight int32 [K/8, N], word i's slot j holding input row 8i + j; qzeros int32 [G, N/8],
  slot j holding column 8c + j, storing zero - 1; scales fp16 [G, N]; g_idx int32 [K].
- GPTQ act-order (`act_order=True`, `desc_act: true`): each linear's input channels are quantized G at a time in a
  permuted order, channel k landing in group g_idx[k] (GPTQ orders them by the Hessian's diagonal; here a seeded
  random permutation, the same for the linears that read one input: gate / up, and q / kv_a, as GPTQ's order comes
  from that input's statistics). For benchmarks of act-order's kernels, not for accuracy.

This file packs with its own loops over the nibble slots (independent of the engine's unpacking
code in deepinfer/backend/native/quant_int4.py, which the tests compare against it).
"""

from __future__ import annotations

import json
import os
import zlib

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


def int4_quantizable(name: str, shape: tuple[int, ...], group: int = GROUP) -> bool:
    """A decoder linear AutoAWQ would quantize: 2-D, K % group == 0, N % 8 == 0; not the router gate or the head."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2
            and not name.endswith("mlp.gate.weight") and shape[1] % group == 0 and shape[0] % 8 == 0)


_SHARED_INPUT = {"gate_proj": "gate_up", "up_proj": "gate_up", "q_proj": "attn_in", "q_a_proj": "attn_in",
                 "kv_a_proj_with_mqa": "attn_in"}


def act_order_permutation_for(name: str, k: int) -> torch.Tensor:
    """The act-order quantization order of `<prefix>.weight`'s k input channels: a permutation seeded by the input the
    linear reads (gate / up one order, q / kv_a one order), so linears GPTQ would order alike are ordered alike."""
    prefix, _, proj = name[: -len(".weight")].rpartition(".")
    site = f"{prefix}.{_SHARED_INPUT.get(proj, proj)}"
    return torch.randperm(k, generator=torch.Generator().manual_seed(zlib.crc32(site.encode())))


def _quantize_tensor(name: str, t: torch.Tensor, method: str, group: int, device: str,
                     act_order: bool = False) -> dict[str, torch.Tensor]:
    """The int4 tensors replacing `<prefix>.weight` (on the CPU, whatever device did the arithmetic)."""
    prefix = name[: -len(".weight")]
    k = t.shape[1]
    perm = act_order_permutation_for(name, k) if act_order else torch.arange(k)
    inv = torch.argsort(perm)
    q, zeros, scales = quantize_int4(t.to(device)[:, perm.to(device)], group)  # groups of G in the quantized order
    q, zeros, scales = q.cpu()[inv], zeros.cpu(), scales.cpu()  # q's rows back in input order
    out = {}
    if method == "awq":
        out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"] = pack_awq_cols(q), pack_awq_cols(zeros)
    else:
        out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"] = pack_gptq(q, zeros)
        out[f"{prefix}.g_idx"] = (inv // group).to(torch.int32)
    out[f"{prefix}.scales"] = scales
    return out


def _shards(src: str) -> tuple[list[str], dict | None]:
    """The safetensors files of `src` in order, and its index (None for a single model.safetensors)."""
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            idx = json.load(f)
        return sorted(set(idx["weight_map"].values())), idx
    return ["model.safetensors"], None


def write_int4_checkpoint(src: str, dst: str, method: str = "awq", group: int = GROUP, device: str = "cpu",
                          progress: bool = False, act_order: bool = False) -> list[str]:
    """Copy the dense checkpoint `src` (one model.safetensors, or shards with an index) to `dst` with every
    quantizable linear stored as AWQ / GPTQ int4 at `group` input channels per scale; returns the prefixes
    quantized. Shard by shard (a 31 GB V2-Lite never sits in memory whole); `device` runs the rounding (cuda:
    seconds instead of minutes). config.json gets AWQ's / GPTQ's quantization_config; other files are copied."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    if method not in ("awq", "gptq"):
        raise ValueError(f"method must be awq or gptq, got {method!r}")
    if group not in (32, 64, 128):
        raise ValueError(f"group size must be 32, 64 or 128, got {group}")
    if act_order and method != "gptq":
        raise ValueError("act_order (desc_act) is GPTQ's; AWQ has no g_idx")
    shards, index = _shards(src)
    os.makedirs(dst, exist_ok=True)
    done: list[str] = []
    weight_map: dict[str, str] = {}
    for n, shard in enumerate(shards):
        out: dict[str, torch.Tensor] = {}
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                t = f.get_tensor(name)
                if int4_quantizable(name, tuple(t.shape), group):
                    out.update(_quantize_tensor(name, t, method, group, device, act_order))
                    done.append(name[: -len(".weight")])
                else:
                    out[name] = t
        save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in out})
        if progress:
            print(f"awq_writer: {shard} ({n + 1}/{len(shards)}), {len(done)} linears so far", flush=True)
    if index is not None:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": index.get("metadata", {}), "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": False,
         "checkpoint_format": "gptq"})
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    written = set(shards) | {"config.json", "model.safetensors.index.json"}
    for extra in os.listdir(src):
        if extra not in written and os.path.isfile(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), os.path.join(dst, extra))
    return done


def main(argv: list[str] | None = None) -> int:
    """python -m deepinfer.checkpoints.awq_writer SRC DST [--method awq|gptq] [--group-size 128] [--device cuda]
    [--act-order]"""
    import argparse

    ap = argparse.ArgumentParser(description="Write an AWQ / GPTQ int4 copy of a dense checkpoint (round-to-nearest, "
                                 "no calibration; deepinfer/checkpoints/awq_writer.py)")
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--method", default="awq", choices=("awq", "gptq"))
    ap.add_argument("--group-size", type=int, default=GROUP, choices=(32, 64, 128))
    ap.add_argument("--device", default="cpu", help="where the rounding runs (cpu, cuda)")
    ap.add_argument("--act-order", action="store_true", help="GPTQ only: desc_act, each linear's inputs quantized "
                    "in a seeded permuted order (g_idx a permutation of k // G)")
    args = ap.parse_args(argv)
    if args.act_order and args.method != "gptq":
        ap.error("--act-order needs --method gptq")
    done = write_int4_checkpoint(args.src, args.dst, args.method, args.group_size, args.device, progress=True,
                                 act_order=args.act_order)
    print(f"awq_writer: {len(done)} linears written as {args.method} int4, group {args.group_size} -> {args.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
