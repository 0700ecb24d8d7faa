"""Linear layers whose weights arrive from a checkpoint and run through the backend's linear method.

The scheme is chosen from what was loaded and the load's `LinearQuantSettings` (quant/settings.py):
an fp8 e4m3 weight with its `weight_scale_inv` runs as "fp8_block" (W8A16) or, when the settings ask
for fp8 activations, "fp8_w8a8"; an int4 record (`Int4Weight`, which the loader hands over under
`<prefix>.weight` for AWQ / GPTQ checkpoints) as "int4_awq" / "int4_gptq"; a dense weight as "none",
or "fp8_w8a8" (quantized at load) under online fp8; an msModelSlim int8 record (`Int8Weight`, int8 weight +
per-channel weight_scale / weight_offset, gathered by the loader the same way) as "int8_w8a8". The
backend's LinearMethod converts the loaded tensors (`process_weights`) and applies them; a backend whose
method runs the quantized format keeps it quantized in memory.

Tensor parallelism (`split`): a "column" layer holds out_features / tp rows of W (its output is this rank's
slice of the columns), a "row" layer in_features / tp columns (its output is a partial sum the caller
all-reduces; the bias is added on tp rank 0 only). The split comes from the backend's "tp" communicator;
its loaders are `SlicedLoader`s, so the checkpoint reader reads only this rank's part. With one rank the
layer is exactly the unsplit one (plain loaders, no slicing). fp8 block scales are sliced with the weight,
so each rank's part must be whole 128-blocks. int4 / int8 records arrive whole and the layer keeps its part
(`Int4Weight.part` / `Int8Weight.part`: packed words, zero points and scales cut together); a part that would cut
a packed word or a quantization group, or a row cut of a GPTQ act-order weight, is refused naming the layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.backend import Backend, Communicator, Fp8Act, Int4Weight, LinearMethod
from deepinfer.errors import ModelLoadError
from deepinfer.models.layers.quant.settings import active_linear_quant
from deepinfer.models.loader import Int8Weight
from deepinfer.models.weights import OTHER_RANK, sliced

FP8_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = 128

Loader = Callable[[torch.Tensor], None]


SPLITS = (None, "column", "row")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tp_communicator(backend: Backend) -> Communicator:
    """The tensor-parallel group's communicator: `Backend.communicator()`'s default group is "tp"."""
    return backend.communicator()


def prepare_weight(
    name: str, t: torch.Tensor, shape: tuple[int, int], quantized: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Check a loaded `<name>.weight` and move it to the device: fp8 stays fp8, an int4 record stays packed,
    dense becomes the compute dtype."""
    if isinstance(t, Int4Weight):
        t.check(name, shape[0], shape[1])
        return Int4Weight(t.method, t.qweight.to(device), t.qzeros.to(device), t.scales.to(device),
                          None if t.g_idx is None else t.g_idx.to(device), t.group_size, t.zero_offset)
    if isinstance(t, Int8Weight):
        t.check(name, shape[0], shape[1])
        return t.to(device)
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"{name}.weight has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype == FP8_DTYPE:
        if not quantized:
            raise ModelLoadError(
                f"{name}.weight is float8_e4m3fn but config.json declares no fp8 quantization_config for this layer"
            )
        return t.to(device)
    if t.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return t.to(device=device, dtype=dtype)
    raise ModelLoadError(f"{name}.weight has unsupported dtype {t.dtype}")


def prepare_scale(name: str, t: torch.Tensor, out_features: int, in_features: int, device: torch.device) -> torch.Tensor:
    """Check a loaded `<name>.weight_scale_inv` (one fp32 scale per 128x128 block)."""
    expect = (_cdiv(out_features, FP8_BLOCK), _cdiv(in_features, FP8_BLOCK))
    if tuple(t.shape) != expect:
        raise ModelLoadError(f"{name}.weight_scale_inv has shape {tuple(t.shape)}, expected {expect}")
    return t.to(device=device, dtype=torch.float32)


class Linear(nn.Module):
    """y = x @ W^T (+ b), W [out, in] as loaded (compute dtype, or fp8 + block scales)."""


    # online quantization (`--quantization fp8` on a dense checkpoint) applies to this layer; the LM head opts
    # out (it stays dense in every fp8 checkpoint too, as vLLM keeps it)
    quantize_online = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        backend: Backend,
        dtype: torch.dtype,
        bias: bool = False,
        quantized: bool = False,
        split: str | None = None,
        tp: Communicator | None = None,
    ):
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"Linear split must be one of {SPLITS}, got {split!r}")
        comm = (tp or tp_communicator(backend)) if split else None
        self.split = split if comm is not None and comm.world_size > 1 else None
        self.tp_size = comm.world_size if self.split else 1
        self.tp_rank = comm.rank if self.split else 0
        self.shard_problem = self._shard_problem(in_features, out_features, quantized)
        if self.split == "column":
            out_features //= self.tp_size
        elif self.split == "row":
            in_features //= self.tp_size
        self.in_features = in_features  # this rank's part
        self.out_features = out_features
        self.backend = backend
        self.dtype = dtype
        self.has_bias = bias
        self.quantized = quantized  # the checkpoint stores this layer as fp8 + weight_scale_inv
        self.weight: torch.Tensor | Int4Weight | Int8Weight | None = None
        self.int4: Int4Weight | None = None  # the packed record handed to an int4 method
        self.weight_scale_inv: torch.Tensor | None = None
        self.weight_scale: torch.Tensor | None = None  # int8_w8a8: per output channel [out, 1]
        self.weight_offset: torch.Tensor | None = None  # int8_w8a8: zero (symmetric), checked by the method
        self.bias: torch.Tensor | None = None
        self.method: LinearMethod | None = None
        self.name = ""

    def _shard_problem(self, in_features: int, out_features: int, quantized: bool) -> str | None:
        """Why this layer cannot be split over the tp ranks (reported with its name by `loaders`), or None."""
        if self.split is None:
            return None
        n = self.tp_size
        size, what = (out_features, "out_features") if self.split == "column" else (in_features, "in_features")
        if size % n:
            return f"{what} {size} does not split evenly over tensor_parallel_size {n}"
        if quantized and (size // n) % FP8_BLOCK:
            return (f"fp8 block-scaled weight: {what} {size} over tensor_parallel_size {n} gives {size // n} per "
                    f"rank, not a multiple of the {FP8_BLOCK}-wide scale blocks")
        return None

    # ------------------------------------------------------------ loading

    def loaders(self, prefix: str) -> dict[str, Loader]:
        """Checkpoint names this layer expects -> setter (split: this rank's part only)."""
        self.name = prefix
        if self.shard_problem is not None:
            raise ModelLoadError(f"{prefix}: cannot split this {self.split}-parallel layer: {self.shard_problem}")
        if self.split is None:
            out = {f"{prefix}.weight": self._set_weight}
            if self.quantized:
                out[f"{prefix}.weight_scale_inv"] = self._set_scale
            if self.has_bias:
                out[f"{prefix}.bias"] = self._set_bias
            return out
        dim, lo, hi = self._rank_part()
        size = hi - lo
        out = {f"{prefix}.weight": sliced(self._set_weight, dim, lo, hi)}
        if self.quantized:  # whole 128-blocks per rank (checked by _shard_problem)
            out[f"{prefix}.weight_scale_inv"] = sliced(self._set_scale, dim, lo // FP8_BLOCK,
                                                       (lo + size) // FP8_BLOCK)
        if self.has_bias:
            if dim == 0:
                out[f"{prefix}.bias"] = sliced(self._set_bias, 0, lo, lo + size)
            else:  # a row-parallel output is summed over the ranks: its bias is added once, on rank 0
                out[f"{prefix}.bias"] = self._set_bias if self.tp_rank == 0 else OTHER_RANK
        return out

    def _rank_part(self) -> tuple[int, int, int]:
        """(dim, start, stop) of this rank's part of the stored [out, in] weight (a split layer only)."""
        dim = 0 if self.split == "column" else 1
        size = self.out_features if dim == 0 else self.in_features
        return dim, self.tp_rank * size, (self.tp_rank + 1) * size

    def _set_weight(self, t: torch.Tensor) -> None:
        if self.split is not None and isinstance(t, (Int4Weight, Int8Weight)):  # records arrive whole: cut here
            t = t.part(*self._rank_part(), f"{self.name}.weight ({self.split}-parallel over tensor_parallel_size "
                                           f"{self.tp_size})")
        self.weight = prepare_weight(self.name, t, (self.out_features, self.in_features), self.quantized, self.dtype,
                                     self.backend.device)

    def _set_scale(self, t: torch.Tensor) -> None:
        self.weight_scale_inv = prepare_scale(self.name, t, self.out_features, self.in_features, self.backend.device)

    def _set_bias(self, t: torch.Tensor) -> None:
        if tuple(t.shape) != (self.out_features,):
            raise ModelLoadError(f"{self.name}.bias has shape {tuple(t.shape)}, expected ({self.out_features},)")
        self.bias = t.to(device=self.backend.device, dtype=self.dtype)

    # ------------------------------------------------------------ after loading

    def scheme(self) -> str:
        if self.weight is None:
            raise ModelLoadError(f"{self.name}.weight was never loaded")
        if isinstance(self.weight, (Int4Weight, Int8Weight)):
            if self.weight_scale_inv is not None:
                raise ModelLoadError(f"{self.name}.weight_scale_inv is given for a {self.weight.scheme} weight")
            return self.weight.scheme
        settings = active_linear_quant()
        if self.weight.dtype == FP8_DTYPE:
            if self.weight_scale_inv is None:
                raise ModelLoadError(f"{self.name}.weight is fp8 but {self.name}.weight_scale_inv is missing")
            return settings.fp8_scheme()
        if self.weight_scale_inv is not None:
            raise ModelLoadError(f"{self.name}.weight_scale_inv is given but {self.name}.weight is not fp8 "
                                 f"(it is {self.weight.dtype})")
        return "fp8_w8a8" if settings.online == "fp8" and self.quantize_online else "none"

    def finalize(self) -> None:
        scheme = self.scheme()
        if isinstance(self.weight, Int4Weight):
            self.int4, self.weight = self.weight, None
        elif isinstance(self.weight, Int8Weight):  # the method reads weight / weight_scale / weight_offset
            rec = self.weight
            self.weight, self.weight_scale, self.weight_offset = rec.weight, rec.weight_scale, rec.weight_offset
        self.method = self.backend.linear_method(scheme)
        self.method.process_weights(self, self.dtype)

    def dense(self) -> torch.Tensor:
        """The weight as dense [out, in] in compute dtype, through the backend (for folding, stacking)."""
        if self.method is None:
            self.finalize()
        return self.method.dense_weight(self)

    def takes_fp8_act(self, num_tokens: int) -> bool:
        """Whether forward reads an Fp8Act's e4m3 values at this token count (the norm before then writes them)."""
        return self.method is not None and self.method.takes_fp8_act(self, num_tokens)

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        if isinstance(x, Fp8Act):
            return self.method.apply_fp8_act(self, x)
        return self.method.apply(self, x)


def _int4_concatenable(records: list) -> bool:
    """int4 parts fuse when they share the packing, group and zero offset and one g_idx (the same input rows):
    their records then concatenate along the output dimension (AWQ / GPTQ pack 8 outputs a word: N % 8 == 0)."""
    first = records[0]
    if not all(isinstance(r, Int4Weight) and (r.method, r.group_size, r.zero_offset) ==
               (first.method, first.group_size, first.zero_offset) for r in records):
        return False
    if any((r.g_idx is None) != (first.g_idx is None) for r in records):
        return False
    return first.g_idx is None or all(torch.equal(r.g_idx, first.g_idx) for r in records)


def _cat_int4(records: list) -> Int4Weight:
    """One record for the parts' outputs side by side: qweight / qzeros / scales concatenated along N."""
    f = records[0]
    cat = lambda name: torch.cat([getattr(r, name) for r in records], dim=1)
    return Int4Weight(f.method, cat("qweight"), cat("qzeros"), cat("scales"), f.g_idx, f.group_size, f.zero_offset)


class MergedLinear(nn.Module):
    """Several linears over the same input, run as one matmul when their weights can be concatenated.

    Output column groups are concatenated in `out_sizes` order. fp8 block scales
    concatenate only when every part but the last fills whole 128-row blocks; int4 records (AWQ / GPTQ)
    when they share packing, group and g_idx; otherwise the parts run one by one and their outputs are
    concatenated.

    `splits`: per part, None (replicated) or "column" (this rank's slice of that part's rows), so a
    merged gate/up or q/kv_a keeps each part's meaning under tensor parallelism; `out_sizes` then
    holds this rank's sizes.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        backend: Backend,
        dtype: torch.dtype,
        biases: list[bool] | None = None,
        quantized: bool = False,
        splits: list[str | None] | None = None,
        tp: Communicator | None = None,
    ):
        super().__init__()
        biases = biases or [False] * len(out_sizes)
        splits = splits or [None] * len(out_sizes)
        if len(splits) != len(out_sizes) or any(sp not in (None, "column") for sp in splits):
            raise ValueError(f"MergedLinear splits must be None or 'column' per part, got {splits!r}")
        self.parts = nn.ModuleList(
            Linear(in_features, n, backend, dtype, bias=b, quantized=quantized, split=sp, tp=tp)
            for n, b, sp in zip(out_sizes, biases, splits)
        )
        self.out_sizes = [p.out_features for p in self.parts]
        self.fused: Linear | None = None
        self.backend = backend
        self.dtype = dtype
        self.in_features = in_features

    def loaders(self, prefixes: list[str]) -> dict[str, Loader]:
        out: dict[str, Loader] = {}
        for part, prefix in zip(self.parts, prefixes):
            out.update(part.loaders(prefix))
        return out

    def _can_fuse(self, schemes: list[str]) -> bool:
        if len(set(schemes)) != 1 or schemes[0].startswith("int8_"):
            return False  # int8 parts run one by one (their records are not concatenated)
        if schemes[0].startswith("int4_"):
            return _int4_concatenable([p.weight for p in self.parts])
        if schemes[0] in ("fp8_block", "fp8_w8a8") and any(p.weight.dtype == FP8_DTYPE for p in self.parts):
            return all(n % FP8_BLOCK == 0 for n in self.out_sizes[:-1])
        return True  # dense parts (online fp8 quantizes the fused matrix)

    def finalize(self) -> None:
        schemes = [p.scheme() for p in self.parts]
        if not self._can_fuse(schemes):
            for p in self.parts:
                p.finalize()
            return
        has_bias = any(p.bias is not None for p in self.parts)
        int4 = isinstance(self.parts[0].weight, Int4Weight)
        stored_fp8 = not int4 and self.parts[0].weight.dtype == FP8_DTYPE
        fused = Linear(self.in_features, sum(self.out_sizes), self.backend, self.dtype, bias=has_bias,
                       quantized=stored_fp8)
        fused.name = "+".join(p.name for p in self.parts)
        if int4:
            fused.weight = _cat_int4([p.weight for p in self.parts])
        else:
            fused.weight = torch.cat([p.weight for p in self.parts], dim=0)
        if stored_fp8:
            fused.weight_scale_inv = torch.cat([p.weight_scale_inv for p in self.parts], dim=0)
        if has_bias:
            fused.bias = torch.cat(
                [p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=self.dtype, device=p.weight.device)
                 for p in self.parts]
            )
        fused.finalize()
        self.fused = fused
        self.parts = nn.ModuleList()  # the loaded copies are no longer needed

    def takes_fp8_act(self, num_tokens: int) -> bool:
        if self.fused is not None:
            return self.fused.takes_fp8_act(num_tokens)
        return any(p.takes_fp8_act(num_tokens) for p in self.parts)

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x)
        return torch.cat([p(x) for p in self.parts], dim=-1)
