"""Random-weight Hugging Face checkpoints for tests and benchmarks (`deepinfer make-checkpoint`)."""

from __future__ import annotations

import json
import os

import torch

from deepinfer.checkpoints.presets import PRESETS, Preset, register_preset
from deepinfer.errors import ConfigError

__all__ = ["PRESETS", "Preset", "make_checkpoint", "register_preset"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_checkpoint(preset: str, out_dir: str, seed: int = 0, progress: bool | None = None,
                    workers: int = 1) -> None:
    """Write config.json, generation_config.json, safetensors (+ index when sharded) and the tokenizer.

    progress: a byte progress bar; None shows it for checkpoints over 512 MiB (v2-lite), not for tiny ones.
    workers: processes writing shards at once (the files are the same for any number).
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; available: {', '.join(sorted(PRESETS))}")
    p = PRESETS[preset]
    from deepinfer.checkpoints.random_weights import write_safetensors
    from deepinfer.checkpoints.tokenizer_factory import write_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    cfg = p.hf_config()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = {"bos_token_id": cfg.get("bos_token_id", 0), "eos_token_id": cfg.get("eos_token_id", 1)}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    write_safetensors(out_dir, p.tensor_plan(cfg, p.fp8), seed, _DTYPES[p.dtype], p.max_shard_bytes,
                      progress=progress, workers=workers)
    write_tokenizer(out_dir, cfg["vocab_size"])
