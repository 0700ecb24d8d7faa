"""A test helper that writes a dense checkpoint's AWQ / GPTQ copy at any group size (routed experts included),
plus its dequantized twin: the same checkpoint with every quantized weight replaced by (q - zero) * scale,
computed here from the writer's integer values (not through the engine's unpacking)."""

from __future__ import annotations

import json
import os
import shutil

import torch

from deepinfer.checkpoints.awq_writer import pack_awq_cols, pack_gptq, quantize_int4


def quantizable(name: str, shape: tuple[int, ...], group: int) -> bool:
    """A decoder linear AutoAWQ would quantize at this group size (not the router gate)."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2
            and not name.endswith("mlp.gate.weight") and shape[1] % group == 0 and shape[0] % 8 == 0)


def _act_order(name: str, k: int) -> torch.Tensor:
    """A channel order per input: weights that share their inputs (an MLP's gate_proj and up_proj, attention's
    q_a / kv_a projections) share it, as GPTQ's desc_act order comes from the inputs' Hessian."""
    shared = name.replace("gate_proj", "up_proj").replace("q_a_proj", "kv_a_proj_with_mqa").replace(
        "q_proj", "kv_a_proj_with_mqa")
    g = torch.Generator().manual_seed(sum(map(ord, shared)) * 7919 % (2**31))
    return torch.randperm(k, generator=g)


def write_int4_pair(src: str, dst: str, twin: str, method: str, group: int, act_order: bool = False) -> list[str]:
    """dst: src in `method` packing at `group`; twin: src with the dequantized weights. Returns the prefixes.
    act_order (GPTQ): every weight quantized in a channel order of its inputs' (`_act_order`), G channels a group
    in that order, g_idx the group of each stored channel, `desc_act: true`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, dense, done = {}, {}, []
    for name, t in tensors.items():
        if not quantizable(name, tuple(t.shape), group):
            out[name] = dense[name] = t
            continue
        prefix = name[: -len(".weight")]
        perm = _act_order(name, t.shape[1]) if act_order else torch.arange(t.shape[1])
        inv = torch.argsort(perm)
        q, z, s = quantize_int4(t[:, perm], group)
        q = q[inv]  # stored channel c was quantized at position inv[c]
        rows = inv // group
        dense[name] = ((q.float() - z.float()[rows]) * s.float()[rows]).t().contiguous()
        if method == "awq":
            out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"] = pack_awq_cols(q), pack_awq_cols(z)
        else:
            out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"] = pack_gptq(q, z)
            out[f"{prefix}.g_idx"] = rows.to(torch.int32)
        out[f"{prefix}.scales"] = s
        done.append(prefix)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    qc = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
          if method == "awq" else
          {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": False,
           "checkpoint_format": "gptq"})
    for path, tens, conf in ((dst, out, {**cfg, "quantization_config": qc}), (twin, dense, {**cfg, "torch_dtype": "float32"})):
        os.makedirs(path, exist_ok=True)
        save_file(tens, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(conf, f, indent=2)
        for extra in os.listdir(src):
            if extra not in ("config.json", "model.safetensors") and os.path.isfile(os.path.join(src, extra)):
                shutil.copy(os.path.join(src, extra), os.path.join(path, extra))
    return done
