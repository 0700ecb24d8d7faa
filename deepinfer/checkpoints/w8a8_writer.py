"""Write msModelSlim W8A8 dynamic ("W8A8_DYNAMIC") checkpoints from a dense one (for tests and benchmarks).

The format, as msModelSlim exports it and vllm-ascend / MindIE load it: every quantized linear stores
`<prefix>.weight` int8 [out, in], `<prefix>.weight_scale` [out, 1] and `<prefix>.weight_offset` [out, 1]
(zeros: symmetric per output channel); `quant_model_description.json` maps every tensor name to
"W8A8_DYNAMIC" or "FLOAT" and carries `"model_quant_type": "W8A8_DYNAMIC"`; config.json gets
`"quantize": "w8a8_dynamic"`. Activations are quantized per token at run time (nothing stored for them).

`quantize_int8_per_channel` is symmetric round-to-nearest: scale = max|w_o| / 127, q = round(w / scale).
msModelSlim's calibration (outlier suppression, smoothing) is not run: the tensor layout, not the
calibration, is what a loader has to get right. Which linears: the decoder's 2-D weights (attention
projections, dense MLPs, experts); the router gate, norms, embeddings and the LM head stay FLOAT.
"""

from __future__ import annotations

import json
import os

import torch

DESCRIPTION = "quant_model_description.json"


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (int8 [out, in], fp32 scale [out, 1]); a zero row gets scale 1."""
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(wf / scale).clamp(-127, 127).to(torch.int8), scale


def int8_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """A decoder linear msModelSlim quantizes for W8A8_DYNAMIC: 2-D `model.layers.*.weight`, not the router gate."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2
            and not name.endswith("mlp.gate.weight"))


def write_w8a8_checkpoint(src: str, dst: str) -> list[str]:
    """Copy the dense checkpoint `src` (a single model.safetensors) to `dst` with every quantizable linear stored as
    W8A8_DYNAMIC int8; returns the prefixes quantized. Tokenizer and other files are copied."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    description: dict[str, str] = {"model_quant_type": "W8A8_DYNAMIC"}
    done = []
    for name, t in tensors.items():
        if not int8_quantizable(name, tuple(t.shape)):
            out[name] = t
            description[name] = "FLOAT"
            continue
        prefix = name[: -len(".weight")]
        q, scale = quantize_int8_per_channel(t)
        out[name], out[f"{prefix}.weight_scale"], out[f"{prefix}.weight_offset"] = q, scale, torch.zeros_like(scale)
        for leaf in ("weight", "weight_scale", "weight_offset"):
            description[f"{prefix}.{leaf}"] = "W8A8_DYNAMIC"
        done.append(prefix)
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg["quantize"] = "w8a8_dynamic"
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(dst, DESCRIPTION), "w", encoding="utf-8") as f:
        json.dump(description, f, indent=2)
    for extra in os.listdir(src):
        if extra not in ("config.json", "model.safetensors", DESCRIPTION) and os.path.isfile(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), os.path.join(dst, extra))
    return done
