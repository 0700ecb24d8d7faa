"""Read a Hugging Face checkpoint directory tensor by tensor.

Single `model.safetensors`, or shards listed by `model.safetensors.index.json`.
Tensors are yielded as stored (bf16 / fp16 / fp32 / fp8 e4m3 + fp32
`weight_scale_inv`); the model's setters convert them to the compute dtype on
the device, so at most one tensor is in flight here.

AWQ / GPTQ checkpoints (config.json `quantization_config.quant_method` awq / gptq) store a linear as
`<prefix>.qweight`, `.qzeros`, `.scales` (+ `.g_idx` for GPTQ). The loader gathers those of one
prefix and yields them as one `Int4Weight` record named `<prefix>.weight`, so every model's name
map stays the same whatever the format (a linear the checkpoint left dense keeps its `.weight`).

msModelSlim W8A8 dynamic checkpoints (config.json `quantize: w8a8_dynamic`, deepinfer/quant_config.py) store a
linear as `<prefix>.weight` int8 [out, in] + `.weight_scale` [out, 1] + `.weight_offset` [out, 1]; the loader
gathers the three into one `Int8Weight` record under `<prefix>.weight` the same way, and checks the set of
int8 linears against the checkpoint's `quant_model_description.json` (every "W8A8_DYNAMIC" weight arrived as
int8 with its scales, no int8 weight it does not list).

Reading a rank's part (tensor / expert parallelism): `iter_checkpoint(..., lazy=True)` yields each plain
tensor as a `StoredTensor`, a handle not yet read. The model hands it with its loader to `deliver`, which
reads only the loader's `part` (safetensors' get_slice) for a `SlicedLoader`, nothing for `OTHER_RANK`
(a tensor another rank holds), the whole tensor otherwise: one read per needed tensor, and none for a
tensor the model skips. int4 / int8 records are read whole and grouped as before; a split layer then keeps its
part (`Int4Weight.part` / `Int8Weight.part`, the packed words, zero points and scales cut together) and the whole
record is dropped, so each rank reads every int4 / int8 tensor of a split layer whole once (packed: a quarter of
bf16's bytes), not only its part.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.backend import Int4Weight
from deepinfer.errors import ModelLoadError
from deepinfer.models.weights import Loader, OtherRankTensor, ShardSlice, SlicedLoader
from deepinfer.quant_config import (
    Int4CheckpointFormat,
    int4_checkpoint_format,
    modelslim_scheme,
    read_modelslim_description,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class Int8Weight:
    """One msModelSlim W8A8 dynamic linear as stored: int8 weight [out, in], weight_scale / weight_offset [out, 1]."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_offset: torch.Tensor

    scheme = "int8_w8a8"

    def check(self, name: str, out_features: int, in_features: int) -> None:
        if self.weight.dtype != torch.int8 or tuple(self.weight.shape) != (out_features, in_features):
            raise ModelLoadError(f"{name}.weight is {self.weight.dtype} {tuple(self.weight.shape)}, expected int8 "
                                 f"{(out_features, in_features)}")
        for part in ("weight_scale", "weight_offset"):
            t = getattr(self, part)
            if tuple(t.shape) not in ((out_features, 1), (out_features,)) or not t.is_floating_point():
                raise ModelLoadError(f"{name}.{part} is {t.dtype} {tuple(t.shape)}, expected a float "
                                     f"({out_features}, 1) (one per output channel)")

    def part(self, dim: int, start: int, stop: int, name: str) -> Int8Weight:
        """A tensor-parallel rank's slice, [out, in] convention: dim 0 cuts output channels (their scales and
        offsets with them), dim 1 input channels (per-output-channel scales apply whole)."""
        if dim not in (0, 1) or not 0 <= start < stop <= self.weight.shape[dim]:
            raise ModelLoadError(f"{name}: cannot take [{start}:{stop}] along dim {dim} of an int8 weight of shape "
                                 f"{tuple(self.weight.shape)}")
        if dim == 1:
            return Int8Weight(self.weight[:, start:stop].contiguous(), self.weight_scale, self.weight_offset)
        return Int8Weight(self.weight[start:stop].contiguous(), self.weight_scale[start:stop].contiguous(),
                          self.weight_offset[start:stop].contiguous())

    def to(self, device: torch.device) -> Int8Weight:
        return Int8Weight(self.weight.to(device), self.weight_scale.to(device, torch.float32),
                          self.weight_offset.to(device, torch.float32))


# safetensors dtype names -> torch (those a DeepSeek checkpoint may hold)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
# DeepSeek-V4's fp4 experts: ue8m0 scales (and packed e2m1 where a writer stores that dtype)
_ST_DTYPES.update({k: getattr(torch, v) for k, v in (("F8_E8M0", "float8_e8m0fnu"), ("F4", "float4_e2m1fn_x2"))
                   if hasattr(torch, v)})


@dataclass
class ReadStats:
    """What was read from the checkpoint: per tensor name the shapes read (a part or the whole), and bytes."""

    shapes: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    bytes_read: int = 0

    def record(self, name: str, t: torch.Tensor) -> None:
        self.shapes.setdefault(name, []).append(tuple(t.shape))
        self.bytes_read += t.numel() * t.element_size()


@dataclass
class StoredTensor:
    """A checkpoint tensor not read yet: its name, stored shape and dtype, and the open file it lives in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: a dtype not in _ST_DTYPES (read() still returns what safetensors gives)
    handle: Any  # a safetensors safe_open handle
    stats: ReadStats | None = None

    def read(self, part: ShardSlice | None = None) -> torch.Tensor:
        """The whole tensor, or only t[start:stop] along part.dim (the rest of the file is never touched)."""
        if part is None:
            t = self.handle.get_tensor(self.name)
        else:
            if not 0 <= part.dim < len(self.shape) or not 0 <= part.start < part.stop <= self.shape[part.dim]:
                raise ModelLoadError(f"{self.name} has shape {self.shape}: cannot read [{part.start}:{part.stop}] "
                                     f"along dim {part.dim} (this rank's part of it)")
            index = slice(part.start, part.stop)
            t = self.handle.get_slice(self.name)[(slice(None),) * part.dim + (index,) if part.dim else index]
        if self.stats is not None:
            self.stats.record(self.name, t)
        return t


def _whole(t):
    return t.read() if isinstance(t, StoredTensor) else t


def deliver(loader: Loader, value) -> None:
    """Hand a checkpoint value to its loader: only the loader's part of it (SlicedLoader), nothing for a
    tensor another rank holds (OTHER_RANK), the whole of it otherwise. `value` is a StoredTensor (read
    here), a tensor already in memory (a part is then a view of it), or an int4 / int8 record (handed
    whole: the layer decides whether it can take it)."""
    if isinstance(loader, OtherRankTensor):
        return
    if not isinstance(loader, SlicedLoader):
        loader(_whole(value))
        return
    part = loader.part
    if isinstance(value, StoredTensor):
        loader.fn(value.read(part))
    elif isinstance(value, torch.Tensor):
        loader.fn(value.narrow(part.dim, part.start, part.stop - part.start))
    else:
        loader.fn(value)


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


def iter_checkpoint(path: str, progress: bool = True, lazy: bool = False, stats: ReadStats | None = None
                    ) -> Iterator[tuple[str, torch.Tensor | StoredTensor | Int4Weight | Int8Weight]]:
    """Yield (name, tensor) for every tensor of the checkpoint (int4 / int8 linears as one record, see above).

    lazy: plain tensors come as `StoredTensor` handles, read by `deliver` (only the part a rank needs);
    otherwise each is read whole here. stats: counts what is read."""
    for name, t in _grouped(path, progress, stats):
        yield name, (t if lazy else _whole(t))


def _grouped(path: str, progress: bool, stats: ReadStats | None
             ) -> Iterator[tuple[str, StoredTensor | Int4Weight | Int8Weight]]:
    stream = _iter_tensors(path, progress, stats)
    int8_ckpt: bool | None = None  # config.json read only when an int8 tensor or a per-channel scale shows up
    for name, t in stream:
        if int8_ckpt is None and (t.dtype == torch.int8 or name.endswith((".weight_scale", ".weight_offset"))):
            int8_ckpt = modelslim_scheme(_read_config(path)) == "int8_w8a8"
            if int8_ckpt:  # msModelSlim W8A8 dynamic: every tensor from here on through the gatherer
                yield from group_int8(itertools.chain([(name, t)], stream), read_modelslim_description(path))
                return
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
        got[leaf] = _whole(t)
        if len(got) == len(parts):
            del pending[prefix]
            yield f"{prefix}.weight", Int4Weight(fmt.method, got["qweight"], got["qzeros"], got["scales"],
                                                 got.get("g_idx"), fmt.group_size, fmt.zero_offset)
    if pending:
        prefix, got = sorted(pending.items())[0]
        missing = [p for p in parts if p not in got]
        raise ModelLoadError(f"{fmt.method} checkpoint: {prefix} lacks {', '.join(prefix + '.' + m for m in missing)}"
                             f" ({len(pending)} linear(s) incomplete)")


_INT8_PARTS = ("weight", "weight_scale", "weight_offset")


def group_int8(stream: Iterator[tuple[str, torch.Tensor]], description: dict[str, str]
               ) -> Iterator[tuple[str, torch.Tensor | Int8Weight]]:
    """Pass tensors through; gather each W8A8_DYNAMIC linear's three parts and yield them as `<prefix>.weight`."""
    quantized = {n[: -len(".weight")] for n, kind in description.items()
                 if kind == "W8A8_DYNAMIC" and n.endswith(".weight")}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    for name, t in stream:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in _INT8_PARTS or prefix not in quantized:
            if t.dtype == torch.int8 or leaf in _INT8_PARTS[1:]:
                raise ModelLoadError(f"{name}: an int8 linear's tensor, but {prefix}.weight is not listed as "
                                     "W8A8_DYNAMIC in quant_model_description.json")
            yield name, t
            continue
        got = pending.setdefault(prefix, {})
        got[leaf] = _whole(t)
        if len(got) == len(_INT8_PARTS):
            del pending[prefix]
            done.add(prefix)
            yield f"{prefix}.weight", Int8Weight(got["weight"], got["weight_scale"], got["weight_offset"])
    missing = sorted(quantized - done)
    if missing:
        prefix = missing[0]
        lacks = [p for p in _INT8_PARTS if p not in pending.get(prefix, {})]
        raise ModelLoadError(f"W8A8_DYNAMIC checkpoint: {prefix} lacks {', '.join(prefix + '.' + p for p in lacks)} "
                             f"({len(missing)} linear(s) listed in quant_model_description.json incomplete)")


def _iter_tensors(path: str, progress: bool, stats: ReadStats | None = None
                  ) -> Iterator[tuple[str, StoredTensor]]:
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
                sl = h.get_slice(key)
                dtype = sl.get_dtype()
                yield key, StoredTensor(key, tuple(sl.get_shape()), _ST_DTYPES.get(dtype), h, stats)
                bar.update(1)
    finally:
        bar.close()
