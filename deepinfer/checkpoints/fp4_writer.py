"""Write a DeepSeek-V4 checkpoint whose routed experts are fp4, from a dense one (for tests), and its twin.

The format (backend/native/quant_fp4.py, as transformers 5.24 reads DeepSeek-V4's release): each routed expert
projection `layers.N.ffn.experts.E.{w1,w2,w3}.weight` is int8 [out, in / 2] holding two e2m1 values per byte
(low nibble first) with `.scale` float8_e8m0fnu [out, in / 32] beside it (DeepSeek's name for the scale; the
shared expert and the other linears are left as they are); config.json's quantization_config says
`quant_method: fp8`, `weight_block_size: [128, 128]`, `expert_dtype: fp4`, `scale_fmt: ue8m0`.

The twin (`write_fp4_twin`) stores the same experts dequantized (fp32), every fp8 linear dequantized too, and no
quantization_config: what the fp4 checkpoint must compute, loaded without any fp4 / fp8 code. The quantizer is `quantize_fp4` (amax / 6 per group,
rounded up to a power of two, nearest e2m1): a faithful round trip of the layout, not a tuned recipe.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

from deepinfer.backend import dequant_fp4, dequant_fp8_block, quantize_fp4

EXPERT_WEIGHT = re.compile(r"^(?:model\.)?layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


def _copy_others(src: str, dst: str) -> None:
    for extra in os.listdir(src):
        if extra not in ("config.json", "model.safetensors") and os.path.isfile(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), os.path.join(dst, extra))


def _rewrite(src: str, dst: str, fp4: bool) -> list[str]:
    from safetensors.torch import load_file, save_file

    path = os.path.join(src, "model.safetensors")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: the fp4 writer takes a single-file checkpoint")
    tensors = load_file(path)
    out: dict[str, torch.Tensor] = {}
    done = []
    expert_scales = {n[: -len(".weight")] + s for n in tensors if EXPERT_WEIGHT.match(n)
                     for s in (".weight_scale_inv", ".scale")}
    for name, t in tensors.items():
        if name in expert_scales:
            continue  # an fp8 expert's block scale: the expert is re-stored fp4 below
        if not EXPERT_WEIGHT.match(name):
            if not fp4 and name.endswith((".weight_scale_inv", ".scale")) and \
                    tensors.get(name.rsplit(".", 1)[0] + ".weight", torch.empty(0)).dtype == torch.float8_e4m3fn:
                continue  # the twin stores every fp8 linear dequantized
            if not fp4 and t.dtype == torch.float8_e4m3fn:
                stem = name[: -len(".weight")]
                t = dequant_fp8_block(t, tensors.get(stem + ".weight_scale_inv", tensors.get(stem + ".scale")))
            out[name] = t
            continue
        if t.dtype == torch.float8_e4m3fn:  # an fp8 source (V4 releases' other linears stay fp8): dequantize first
            stem = name[: -len(".weight")]
            s = tensors.get(stem + ".weight_scale_inv", tensors.get(stem + ".scale"))
            if s is None:
                raise ValueError(f"{name} is fp8 but has no weight_scale_inv / scale")
            t = dequant_fp8_block(t, s)
        packed, scale = quantize_fp4(t.float())
        if fp4:
            out[name] = packed.view(torch.int8)
            out[name[: -len(".weight")] + ".scale"] = scale.view(torch.float8_e8m0fnu)
        else:
            out[name] = dequant_fp4(packed, scale)  # fp32: exact (e2m1 times a power of two)
        done.append(name)
    if not done:
        raise ValueError(f"{src}: no routed-expert weights (layers.N.ffn.experts.E.w1/w2/w3.weight) to quantize")
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if fp4:
        q = dict(cfg.get("quantization_config") or {"quant_method": "fp8", "weight_block_size": [128, 128]})
        q.update({"expert_dtype": "fp4", "scale_fmt": "ue8m0"})
        cfg["quantization_config"] = q
    else:
        cfg.pop("quantization_config", None)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    _copy_others(src, dst)
    return done


def write_fp4_checkpoint(src: str, dst: str) -> list[str]:
    """Copy the V4 checkpoint `src` to `dst` with every routed expert stored fp4; returns the weights converted."""
    return _rewrite(src, dst, fp4=True)


def write_fp4_twin(src: str, dst: str) -> list[str]:
    """Copy `src` to `dst` with every routed expert replaced by its fp4 round trip, stored dense."""
    return _rewrite(src, dst, fp4=False)
