"""Read a Hugging Face checkpoint directory tensor by tensor.

Single `model.safetensors`, or shards listed by `model.safetensors.index.json`.
Tensors are yielded as stored (bf16 / fp16 / fp32 / fp8 e4m3 + fp32
`weight_scale_inv`); the model's setters convert them to the compute dtype on
the device, so at most one tensor is in flight here.

AWQ / GPTQ checkpoints (config.json `quantization_config.quant_method` awq / gptq) store a linear as
`<prefix>.qweight`, `.qzeros`, `.scales` (+ `.g_idx` for GPTQ). The loader gathers those of one
prefix and yields them as one `Int4Weight` record named `<prefix>.weight`, so every model's name
map stays the same whatever the format (a linear the checkpoint left dense keeps its `.weight`).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from deepinfer.backend import Int4Weight
from deepinfer.errors import ModelLoadError
from deepinfer.quant_config import Int4CheckpointFormat, int4_checkpoint_format

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


def iter_checkpoint(path: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """Yield (name, tensor) for every tensor of the checkpoint (int4 linears as one record, see above)."""
    stream = _iter_tensors(path, progress)
    for name, t in stream:
        if name.endswith((".qweight", ".qzeros", ".g_idx")):  # int4: config.json says which packing (read only then)
            fmt = int4_checkpoint_format(_read_config(path))
            if fmt is None:
                raise ModelLoadError(f"{name}: a packed int4 tensor, but config.json declares no awq / gptq "
                                     "quantization_config")
            yield from group_int4(itertools.chain([(name, t)], stream), fmt)
            return
        yield name, t


def _read_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{file}: cannot read: {exc}") from exc
    return data if isinstance(data, dict) else {}


_INT4_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}


def group_int4(stream: Iterator[tuple[str, torch.Tensor]], fmt: Int4CheckpointFormat
               ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """Pass tensors through; gather each linear's packed int4 parts and yield them as `<prefix>.weight`."""
    parts = _INT4_PARTS[fmt.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in stream:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in parts:
            yield name, t
            continue
        got = pending.setdefault(prefix, {})
        got[leaf] = t
        if len(got) == len(parts):
            del pending[prefix]
            yield f"{prefix}.weight", Int4Weight(fmt.method, got["qweight"], got["qzeros"], got["scales"],
                                                 got.get("g_idx"), fmt.group_size, fmt.zero_offset)
    if pending:
        prefix, got = sorted(pending.items())[0]
        missing = [p for p in parts if p not in got]
        raise ModelLoadError(f"{fmt.method} checkpoint: {prefix} lacks {', '.join(prefix + '.' + m for m in missing)}"
                             f" ({len(pending)} linear(s) incomplete)")


def _iter_tensors(path: str, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
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
