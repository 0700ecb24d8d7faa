"""Read a Hugging Face checkpoint directory tensor by tensor.

Single `model.safetensors`, or shards listed by `model.safetensors.index.json`.
Tensors are yielded as stored (bf16 / fp16 / fp32 / fp8 e4m3 + fp32
`weight_scale_inv`); the model's setters convert them to the compute dtype on
the device, so at most one tensor is in flight here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from deepinfer.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class CheckpointFiles:
    """The safetensors files of a checkpoint and which tensor lives where."""

    files: list[str]  # absolute paths, in load order
    weight_map: dict[str, str] | None  # tensor name -> file name, when an index exists


def find_checkpoint_files(path: str) -> CheckpointFiles:
    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory {path!r} does not exist or is not a directory")
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{index}: cannot read the shard index: {exc}") from exc
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: 'weight_map' is missing or empty")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise ModelLoadError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return CheckpointFiles([os.path.join(path, n) for n in names], weight_map)
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return CheckpointFiles([single], None)
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if found:
        return CheckpointFiles([os.path.join(path, f) for f in found], None)
    raise ModelLoadError(f"no safetensors weights in {path!r} (expected {SINGLE_FILE} or {INDEX_FILE})")


def iter_checkpoint(path: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, with a tqdm bar over tensors."""
    from safetensors import safe_open

    ckpt = find_checkpoint_files(path)
    handles = []
    total = 0
    for file in ckpt.files:
        try:
            h = safe_open(file, framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{file}: not a readable safetensors file: {exc}") from exc
        keys = list(h.keys())
        if ckpt.weight_map is not None:
            base = os.path.basename(file)
            listed = {k for k, v in ckpt.weight_map.items() if v == base}
            absent = sorted(listed - set(keys))
            if absent:
                raise ModelLoadError(f"{file} lacks tensors that {INDEX_FILE} places there: {', '.join(absent[:10])}")
        handles.append((file, h, keys))
        total += len(keys)

    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress, dynamic_ncols=True)
    try:
        for i, (file, h, keys) in enumerate(handles):
            bar.set_postfix_str(f"shard {i + 1}/{len(handles)}")
            for key in keys:
                yield key, h.get_tensor(key)
                bar.update(1)
    finally:
        bar.close()
