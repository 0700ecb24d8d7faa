"""model_type -> model class, imported lazily; and `load_model`, the one way the engine builds a model."""

from __future__ import annotations

import importlib
import json
import os
from typing import TYPE_CHECKING

import torch

from deepinfer.backend import Backend
from deepinfer.errors import ModelLoadError, UnsupportedModelError
from deepinfer.models.base import CausalLM

if TYPE_CHECKING:
    from deepinfer.models.loader import ReadStats

# model_type -> "module:Class". Classes take (config.json dict, backend, dtype).
MODEL_REGISTRY: dict[str, str] = {
    "deepseek_v2": "deepinfer.models.deepseek_v3.model:DeepseekV2ForCausalLM",
    "deepseek_v3": "deepinfer.models.deepseek_v3.model:DeepseekV2ForCausalLM",
    "deepseek_v4": "deepinfer.models.deepseek_v4.model:DeepseekV4ForCausalLM",
}

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_hf_config(path: str) -> dict:
    """config.json of a local model directory as a dict."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ModelLoadError(f"model directory {str(path)!r} does not exist or is not a directory")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ModelLoadError(f"{file} not found: {path!r} is not a Hugging Face model directory")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{file} is not valid JSON: {exc}") from exc
    except OSError as exc:
        raise ModelLoadError(f"{file} cannot be read: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{file} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def model_class_for(hf_config: dict) -> type[CausalLM]:
    model_type = hf_config.get("model_type")
    if model_type is None:
        raise ModelLoadError("config.json has no 'model_type'")
    target = MODEL_REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if target is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(MODEL_REGISTRY))})"
        )
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def config_dtype(hf_config: dict) -> torch.dtype | None:
    """The checkpoint's own dtype (`torch_dtype` / `dtype`), for dtype="auto"; None when unstated or fp8."""
    name = hf_config.get("torch_dtype", hf_config.get("dtype"))
    return _DTYPES.get(name) if isinstance(name, str) else None


def load_model(path: str, backend: Backend, dtype: torch.dtype, progress: bool = True,
               hf_config: dict | None = None, load_mtp: bool = False,
               read_stats: "ReadStats | None" = None) -> CausalLM:
    """Build the model for `path`, load its weights (tqdm bar) and let the backend convert them.

    load_mtp: also build and load the checkpoint's MTP modules (model families that support it).

    `hf_config`: config.json of `path` when the caller has already parsed it (the engine's start-up
    does, so the file is read once); None reads it here.

    Under tensor parallelism (the backend's "tp" communicator spans several ranks) the model holds this
    rank's shard and, for a class that `reads_stored_tensors`, reads only that shard from the files.
    read_stats: filled with what was read (tests, diagnostics)."""
    from deepinfer.models.loader import iter_checkpoint

    if hf_config is None:
        hf_config = load_hf_config(path)
    cls = model_class_for(hf_config)
    tp = backend.communicator().world_size  # the "tp" group
    if tp > 1 and not cls.supports_tensor_parallel:
        raise ModelLoadError(f"{cls.__name__} (model_type {hf_config.get('model_type')!r}) cannot be split over "
                             f"tensor_parallel_size {tp} yet; run it with tensor_parallel_size 1")
    extra = {}
    if load_mtp:
        if not getattr(cls, "loads_mtp", False):
            raise ModelLoadError(f"{cls.__name__} cannot load MTP modules yet (load_mtp=True)")
        extra["load_mtp"] = True
    with torch.device(backend.device):
        model = cls(hf_config, backend, dtype, **extra)
    model.load_weights(iter_checkpoint(path, progress=progress, lazy=cls.reads_stored_tensors, stats=read_stats))
    model.finalize()
    model.eval()
    return model
