"""Shared helpers for tests/models: tiny checkpoints written once per process, HF reference models, our models."""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import shutil
import tempfile

import torch

from deepinfer.checkpoints import make_checkpoint

_ROOT = tempfile.mkdtemp(prefix="deepinfer-models-tests-")
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)

TINY_PRESETS = ["tiny-v2-lite", "tiny-v2", "tiny-v3", "tiny-v3-fp8"]


@functools.lru_cache(maxsize=None)
def checkpoint(preset: str, seed: int = 0) -> str:
    out = os.path.join(_ROOT, f"{preset}-{seed}")
    make_checkpoint(preset, out, seed=seed)
    return out


def dequantize_reference(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Independent of the engine: expand each 128x128 block's scale over its block and multiply."""
    out_f, in_f = weight.shape
    full = scale_inv.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:out_f, :in_f]
    return weight.to(torch.float32) * full


@functools.lru_cache(maxsize=None)
def dequantized_copy(preset: str) -> str:
    """An fp32 copy of an fp8 checkpoint (no quantization_config) for the HF reference on CPU.

    Why not transformers' own fp8 loading: on CPU it needs `accelerate` and dequantizes with a block size
    derived as rows // scale_rows, which is wrong for partial 128-blocks (a 192x96 weight with a 2x1 scale
    grid gets 96-row blocks; a real V3 kv_a_proj_with_mqa, 576 rows, fails outright). DeepSeek's own
    `weight_dequant` uses scale[i // 128, j // 128], which is what `dequantize_reference` does.
    (Checked by hand with accelerate installed: that path loads tiny-v3-fp8 with no missing/unexpected keys.)
    """
    from safetensors.torch import load_file, save_file

    src = checkpoint(preset)
    dst = os.path.join(_ROOT, f"{preset}-dequant")
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_reference(t, tensors[name[: -len("weight")] + "weight_scale_inv"])
        out[name] = t.to(torch.float32).contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"))
    return dst


@functools.lru_cache(maxsize=None)
def hf_model(preset: str):
    """The transformers reference in fp32, with its loading report."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    path = dequantized_copy(preset) if preset.endswith("fp8") else checkpoint(preset)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def hf_logits(preset: str, ids: list[int]) -> torch.Tensor:
    model, _ = hf_model(preset)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@functools.lru_cache(maxsize=None)
def our_model(preset: str, dtype: torch.dtype = torch.float32):
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.registry import load_model

    return load_model(checkpoint(preset), CPUBackend(), dtype, progress=False)


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist() for n in lengths]


def n_blocks(tokens: int, block: int = 16) -> int:
    return math.ceil(tokens / block)


def variant_checkpoint(preset: str, name: str, **changes) -> str:
    """A preset's config with `changes`, weights drawn from the same plan (no tokenizer: models do not need it)."""
    from deepinfer.checkpoints import PRESETS
    from deepinfer.checkpoints.random_weights import write_safetensors

    p = PRESETS[preset]
    cfg = {**p.hf_config(), **changes}
    out = os.path.join(_ROOT, f"{preset}-{name}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_safetensors(out, p.tensor_plan(cfg, p.fp8), 0, torch.float32)
    return out
