"""A tiny-v3 checkpoint with one MTP module, for the tensor-parallel tests (tests/parallel/test_tensor_parallel_model.py,
test_parallel_speculation.py): the presets carry none."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def with_mtp(root: str, src: str, name: str) -> str:
    """tiny-v3 plus one MTP module (layer 3): its decoder layer a copy of layer 2's tensors, random eh_proj,
    and its own copy of the output head (shared_head.head), as the released V3 files store them; the source's other
    files (tokenizer, generation config) copied."""
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": 1}, f)
    t = load_file(os.path.join(src, "model.safetensors"))
    n, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    for k in [k for k in t if k.startswith(f"model.layers.{n - 1}.")]:
        t[k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")] = t[k].clone()
    g = torch.Generator().manual_seed(3)
    t[f"model.layers.{n}.eh_proj.weight"] = (torch.randn(D, 2 * D, generator=g) * 0.05).to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        t[f"model.layers.{n}.{norm}.weight"] = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16)
    t[f"model.layers.{n}.shared_head.head.weight"] = t["lm_head.weight"].clone()
    save_file(t, os.path.join(out, "model.safetensors"))
    for name in os.listdir(src):  # the tokenizer and generation config, as the source has them
        if not os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out, name))
    return out
