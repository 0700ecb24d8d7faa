"""The routed experts' checkpoint tensors, from one tensor per expert to the stacked w13 / w2 the MoE op takes,
and where the experts live when they are spread over ranks (`ExpertPlacement`).

Checkpoints store one tensor per expert and projection (V2/V3:
`experts.E.{gate,up,down}_proj`, V4: `experts.E.{w1,w3,w2}`). They are held
as plain tensors while loading (V3 has 44k of them, too many to make modules
of), then either kept quantized and stacked into a `QuantizedExperts` record, when the backend's MoE op
runs that scheme (`op.quantized_expert_schemes()`: "fp8_block" / "fp8_w8a8" e4m3 + 128x128 scales (a bf16
checkpoint's experts are quantized to it as they load under online fp8), "fp4" V4's e2m1 +
per-32 scales, "int4_awq" / "int4_gptq" repacked by quant/int4_experts.py), or densified through the
backend's linear method (fp8: dequantized by the backend, not here; fp4: dequantized by the native oracle)
and stacked dense, as every op takes. An int4 (AWQ / GPTQ) expert arrives as an `Int4Weight` record; kept int4 when the op runs the scheme and every projection is int4,
else densified the same way (docs/quantization.md).

Many ranks (docs/parallelism.md): without expert parallelism each rank holds every expert's slice of the
intermediate dimension (`tp_part`: gate / up rows and down columns [r * I/tp, (r + 1) * I/tp)); with it each
rank holds whole experts, the ones its physical slots name (`slot_experts`), and the other experts' tensors
get the OTHER_RANK loader (expected, never read here). An expert placed twice on one rank is read once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backend import (
    FP4_GROUP,
    INT4_ACT_ORDER,
    Backend,
    Int4Weight,
    QuantizedExperts,
    act_order_permutation,
    as_fp4_scale,
    as_packed_fp4,
    dequant_fp4,
    quantize_weight_fp8_block,
)
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.models.layers.linear import FP8_BLOCK, Linear, Loader, prepare_scale, prepare_weight
from deepinfer.models.layers.quant.int4_experts import int4_scheme_of, stack_int4_experts
from deepinfer.models.layers.quant.settings import active_linear_quant
from deepinfer.models.weights import OTHER_RANK, sliced


@dataclass(frozen=True)
class ExpertPlacement:
    """Physical expert slots over the "ep" ranks: slot s holds logical expert slot_experts[s] and lives on rank
    s // slots_per_rank. More slots than logical experts = redundant replicas of hot experts (the expert load
    balancer places them, deepinfer/parallel/eplb.py). Every logical expert has at least one slot."""

    num_experts: int
    ep_size: int
    slot_experts: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.slot_experts)
        if self.ep_size < 1 or n % self.ep_size:
            raise ConfigError(f"expert placement: {n} physical slots do not split evenly over {self.ep_size} "
                              "expert-parallel ranks (n_routed_experts + eplb_num_redundant_experts must be a "
                              "multiple of the world size)")
        if any(not 0 <= e < self.num_experts for e in self.slot_experts):
            raise ConfigError(f"expert placement names experts outside [0, {self.num_experts})")
        missing = sorted(set(range(self.num_experts)) - set(self.slot_experts))
        if missing:
            raise ConfigError(f"expert placement leaves logical experts {missing[:8]} without a slot")

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """No replicas: rank r holds experts [r * E/ep, (r + 1) * E/ep)."""
        if num_experts % ep_size:
            raise ConfigError(f"n_routed_experts {num_experts} does not split evenly over {ep_size} expert-parallel "
                              "ranks (enable_expert_parallel spreads whole experts over every rank)")
        return cls(num_experts, ep_size, tuple(range(num_experts)))

    @property
    def num_slots(self) -> int:
        return len(self.slot_experts)

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep_size

    def rank_experts(self, rank: int) -> tuple[int, ...]:
        """The logical expert of each of `rank`'s slots, in slot order."""
        s = self.slots_per_rank
        return self.slot_experts[rank * s: (rank + 1) * s]

    def replica_counts(self) -> list[int]:
        counts = [0] * self.num_experts
        for e in self.slot_experts:
            counts[e] += 1
        return counts

    def replica_table(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [E, max replicas] int64: expert e's physical slots in slot order, padded with its first;
        counts [E] int64), for mapping routed pairs to replicas on the device."""
        slots: list[list[int]] = [[] for _ in range(self.num_experts)]
        for s, e in enumerate(self.slot_experts):
            slots[e].append(s)
        width = max(len(v) for v in slots)
        table = torch.tensor([v + [v[0]] * (width - len(v)) for v in slots], dtype=torch.long, device=device)
        return table, torch.tensor([len(v) for v in slots], dtype=torch.long, device=device)


class ExpertWeights:
    """Loaders for `{prefix}.experts.E.{gate,up,down}` and their stacking into (w13 [S, 2I, D], w2 [S, D, I]).

    slot_experts: the logical expert of each stacked slot (expert parallelism: this rank's slots); None = every
    expert in order. tp_part (rank, size): this rank's slice of the intermediate dimension; intermediate_size is
    then the per-rank part and the stored tensors are size * tp wide there.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: Backend,
                 dtype: torch.dtype, quantized: bool, names: tuple[str, str, str],
                 slot_experts: tuple[int, ...] | None = None, tp_part: tuple[int, int] | None = None,
                 fp4: bool = False):
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.backend = backend
        self.dtype = dtype
        self.fp4 = fp4  # V4's e2m1 experts (a per-32 scale each); quantized then means they carry a scale
        self.quantized = quantized or fp4
        self.names = names  # (gate, up, down) projection names
        self.slot_experts = tuple(range(num_experts)) if slot_experts is None else tuple(slot_experts)
        self.tp_part = tp_part if tp_part is not None and tp_part[1] > 1 else None
        if self.tp_part is not None and fp4 and intermediate_size % FP4_GROUP:
            raise ModelLoadError(f"fp4 routed experts: moe_intermediate_size {intermediate_size * tp_part[1]} over "
                                 f"tensor_parallel_size {tp_part[1]} gives {intermediate_size} per rank, not a "
                                 f"multiple of the {FP4_GROUP}-wide scale groups")
        if self.tp_part is not None and quantized and not fp4 and intermediate_size % FP8_BLOCK:
            raise ModelLoadError(f"fp8 block-scaled routed experts: moe_intermediate_size {intermediate_size * tp_part[1]}"
                                 f" over tensor_parallel_size {tp_part[1]} gives {intermediate_size} per rank, not a "
                                 f"multiple of the {FP8_BLOCK}-wide scale blocks")
        self.prefix = ""
        self._loaded: dict[tuple[int, str, str], torch.Tensor] = {}  # (expert, proj, "weight"|"scale") -> tensor
        self._whole: set[tuple[int, str, str]] = set()  # act-order int4 records not cut yet (`_cut_act_order`)
        self.num_sorted_cuts = 0  # experts whose act-order intermediate was sorted by group before the cut

    def _shape(self, proj: str) -> tuple[int, int]:
        """[out, in] of one projection (this rank's part): down is [D, I], gate and up are [I, D]."""
        if proj == self.names[2]:
            return self.hidden_size, self.intermediate_size
        return self.intermediate_size, self.hidden_size

    @property
    def scheme(self) -> str | None:
        """The QuantizedExperts scheme these experts are stored in (None: dense); int4 (AWQ / GPTQ) is read from
        the loaded records (models/layers/quant/int4_experts.py). fp8 experts (a checkpoint's, or quantized at
        load under online fp8) run as the load's linears do: "fp8_w8a8" when it asks for fp8 activations
        (`--quantization fp8`), else "fp8_block" (W8A16)."""
        if self.fp4:
            return "fp4"
        weights = [t for (_, _, kind), t in self._loaded.items() if kind == "weight"]
        if self.quantized or any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in weights):
            return active_linear_quant().fp8_scheme()
        return int4_scheme_of(weights)

    @property
    def group_size(self) -> int:
        """Input channels per scale of the loaded int4 records (128 otherwise: fp8 blocks)."""
        for (_, _, kind), t in self._loaded.items():
            if kind == "weight" and hasattr(t, "group_size"):
                return t.group_size
        return 128

    def _split_size(self, proj: str, kind: str) -> int:
        """This rank's extent of a stored tensor along the split (intermediate) dimension: rows of gate / up,
        columns of down; fp4 down packs two per byte and has one scale per 32, fp8 one scale per 128."""
        i = self.intermediate_size
        if kind == "weight":
            return i // 2 if self.fp4 and proj == self.names[2] else i
        if self.fp4:
            return i // FP4_GROUP if proj == self.names[2] else i
        return i // FP8_BLOCK

    def _part(self, t, proj: str, kind: str, name: str):
        """This rank's slice of a stored tensor along the intermediate dimension. The reader may hand the
        whole tensor (a reader that does not slice) or just the part: told apart by the shape."""
        if self.tp_part is None:
            return t
        dim = 1 if proj == self.names[2] else 0
        rank, _ = self.tp_part
        size = self._split_size(proj, kind)
        if not isinstance(t, torch.Tensor):  # an int4 / int8 record, read whole: its packed words cut together
            if isinstance(t, Int4Weight) and t.act_order:
                return t  # kept whole until its expert's three projections are here (`_cut_act_order`)
            return t.part(dim, rank * size, (rank + 1) * size, self._where(name))
        if t.dim() == 2 and t.shape[dim] == size:
            return t  # already this rank's part
        if t.dim() == 2 and t.shape[dim] == size * self.tp_part[1]:
            return t.narrow(dim, rank * size, size)
        raise ModelLoadError(f"{name} has shape {tuple(t.shape)}: dim {dim} is neither this rank's part ({size}) nor "
                             f"the whole ({size * self.tp_part[1]})")

    def _where(self, name: str) -> str:
        return f"{name} (routed experts over tensor_parallel_size {self.tp_part[1]})"

    def _cut_act_order(self, e: int) -> None:
        """Tensor parallelism over GPTQ act-order experts: once expert e's three records are here, those kept whole
        (act-order ones, `_part`) are cut to this rank's part. A down projection's act-order inputs (the
        intermediate) are sorted by group first, and the gate and up rows (whose outputs they are) put in the same
        order, a permutation of the intermediate that leaves the expert's function as it was; then the sorted
        intermediate is cut like any other, so a rank's part holds whole groups (where I / tp is a multiple of the
        group size; else the part's error names the cut). vLLM's GPTQ-Marlin MoE sorts by g_idx per rank for the
        same reason. The whole records live only until their expert's last projection arrives."""
        keys = [(e, p, "weight") for p in self.names]
        if not any(k in self._whole for k in keys) or any(k not in self._loaded for k in keys):
            return
        gate, up, down = (self._loaded[k] for k in keys)
        name = f"{self.prefix}.experts.{e}"
        rank, _ = self.tp_part
        lo, hi = rank * self.intermediate_size, (rank + 1) * self.intermediate_size
        if keys[2] in self._whole:
            if keys[0] not in self._whole or keys[1] not in self._whole:
                raise ModelLoadError(f"{self._where(name)}: the down projection is GPTQ act-order but the gate / up "
                                     "projections are not, so the intermediate cannot be sorted by group before the "
                                     "cut; set enable_expert_parallel (each expert whole on one rank)")
            perm = act_order_permutation(down.g_idx, down.group_size, f"{name}.{self.names[2]}")
            down = down.reorder_inputs(perm, f"{name}.{self.names[2]}").part(1, lo, hi, self._where(
                f"{name}.{self.names[2]} (its inputs sorted by group)"))
            gate, up = (r.reorder_outputs(perm, f"{name}.{p}") for r, p in ((gate, self.names[0]), (up, self.names[1])))
            self._loaded[keys[2]] = down
            self.num_sorted_cuts += 1
        for k, r in zip(keys[:2], (gate, up)):
            if k in self._whole:
                self._loaded[k] = r.part(0, lo, hi, self._where(f"{name}.{k[1]}"))
        for k, r in zip(keys, (self._loaded[k] for k in keys)):
            out_f, in_f = self._shape(k[1])
            r.check(f"{name}.{k[1]}", out_f, in_f)
            self._whole.discard(k)

    def _loader(self, e: int, proj: str, kind: str) -> Loader:
        name = f"{self.prefix}.experts.{e}.{proj}"
        out_f, in_f = self._shape(proj)
        dev = self.backend.device

        def load(t: torch.Tensor) -> None:
            t = self._part(t, proj, kind, f"{name}.{'weight' if kind == 'weight' else 'weight_scale_inv'}")
            if self.tp_part is not None and isinstance(t, Int4Weight) and t.act_order:  # whole until its expert is
                self._whole.add((e, proj, kind))
                whole = (out_f, in_f * self.tp_part[1]) if proj == self.names[2] else (out_f * self.tp_part[1], in_f)
                self._loaded[(e, proj, kind)] = prepare_weight(name, t, whole, self.quantized, self.dtype, dev)
                self._cut_act_order(e)
                return
            if self.fp4:  # kept as stored (uint8 nibbles, e8m0 bytes or fp32 scales), on the device
                conv = as_packed_fp4 if kind == "weight" else as_fp4_scale
                self._loaded[(e, proj, kind)] = conv(name, t, out_f, in_f).to(dev)
            elif kind == "weight":
                w = prepare_weight(name, t, (out_f, in_f), self.quantized, self.dtype, dev)
                online = active_linear_quant().online == "fp8"
                if online and isinstance(w, torch.Tensor) and w.dtype != torch.float8_e4m3fn:
                    # online fp8: each expert quantized as it arrives (128x128 blocks, the linears' rule), so the
                    # layer's experts stay fp8 in memory when the op runs the scheme (a bf16 copy lives only here)
                    w, self._loaded[(e, proj, "scale")] = quantize_weight_fp8_block(w)
                self._loaded[(e, proj, kind)] = w
            else:
                self._loaded[(e, proj, kind)] = prepare_scale(name, t, out_f, in_f, dev)

        if self.tp_part is None:
            return load
        dim = 1 if proj == self.names[2] else 0
        size = self._split_size(proj, kind)
        return sliced(load, dim, self.tp_part[0] * size, (self.tp_part[0] + 1) * size)

    def loaders(self, prefix: str) -> dict[str, Loader]:
        """`prefix` is the MoE block's; the names are `{prefix}.experts.{e}.{proj}.weight` (+ `_scale_inv`)."""
        self.prefix = prefix
        mine = set(self.slot_experts)
        out: dict[str, Loader] = {}
        for e in range(self.num_experts):
            for proj in self.names:
                here = e in mine
                out[f"{prefix}.experts.{e}.{proj}.weight"] = self._loader(e, proj, "weight") if here else OTHER_RANK
                if self.quantized:
                    out[f"{prefix}.experts.{e}.{proj}.weight_scale_inv"] = (
                        self._loader(e, proj, "scale") if here else OTHER_RANK)
        return out

    def _take(self, e: int, proj: str, kind: str) -> torch.Tensor:
        name = f"{self.prefix}.experts.{e}.{proj}.{'weight' if kind == 'weight' else 'weight_scale_inv'}"
        if (e, proj, kind) not in self._loaded:
            raise ModelLoadError(f"{name} was never loaded")
        return self._loaded.pop((e, proj, kind))

    def _dense(self, e: int, proj: str) -> torch.Tensor:
        """One expert matrix as dense compute-dtype [out, in], through the backend's linear method (fp4: the
        native dequantization, no linear method runs fp4)."""
        if self.fp4:
            return dequant_fp4(self._take(e, proj, "weight"), self._take(e, proj, "scale")).to(self.dtype)
        out_f, in_f = self._shape(proj)
        lin = Linear(in_f, out_f, self.backend, self.dtype, quantized=self.quantized)  # an fp8 weight: its scheme
        lin.name = f"{self.prefix}.experts.{e}.{proj}"
        if (e, proj, "weight") not in self._loaded:
            raise ModelLoadError(f"{lin.name}.weight was never loaded")
        lin.weight = self._loaded.pop((e, proj, "weight"))
        lin.weight_scale_inv = self._loaded.pop((e, proj, "scale"), None)
        return lin.dense()

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in the compute dtype, one row per slot; the per-expert tensors are released."""
        S, D, inter = len(self.slot_experts), self.hidden_size, self.intermediate_size
        gate, up, down = self.names
        dev = self.backend.device
        w13 = torch.empty((S, 2 * inter, D), dtype=self.dtype, device=dev)
        w2 = torch.empty((S, D, inter), dtype=self.dtype, device=dev)
        first: dict[int, int] = {}
        for s, e in enumerate(self.slot_experts):
            if e in first:  # a second replica on this rank: copy the first
                w13[s], w2[s] = w13[first[e]], w2[first[e]]
                continue
            first[e] = s
            w13[s, :inter] = self._dense(e, gate)
            w13[s, inter:] = self._dense(e, up)
            w2[s] = self._dense(e, down)
        return w13, w2

    def keeps_quantized(self, op_schemes: tuple[str, ...]) -> bool:
        """Whether to hand the op a QuantizedExperts: it runs this scheme and every weight loaded arrived in it
        (an fp8 checkpoint may leave some experts unquantized: those layers are densified)."""
        if self.scheme is None or self.scheme not in op_schemes:
            return False
        if self.scheme.startswith("int4_"):  # every projection of every expert here an int4 record (scheme says so)
            # GPTQ act-order gate / up projections (QuantizedExperts.w13_g_idx) go to an op that reads their groups
            # (INT4_ACT_ORDER), else densified; a down projection's act-order is resolved at load (int4_experts.py)
            return INT4_ACT_ORDER in op_schemes or not any(
                kind == "weight" and proj != self.names[2] and t.act_order for (_, proj, kind), t in self._loaded.items())
        want = torch.uint8 if self.fp4 else torch.float8_e4m3fn
        weights = [t for (_, _, kind), t in self._loaded.items() if kind == "weight"]
        scales = sum(kind == "scale" for (_, _, kind) in self._loaded)
        return all(isinstance(t, torch.Tensor) and t.dtype == want for t in weights) and scales == len(weights)

    def quantized_stack(self) -> QuantizedExperts:
        """The experts as stored, stacked one row per slot (QuantizedExperts' layout for self.scheme); the
        per-expert tensors are released. A second replica on this rank copies the first."""
        scheme = self.scheme  # read from the loaded records, which the stacking releases
        if scheme is None:
            raise ModelLoadError("quantized_stack: these routed experts are not quantized")
        gate, up, down = self.names
        if scheme.startswith("int4_"):
            seen: dict[int, int] = {}
            slots = []
            for s, e in enumerate(self.slot_experts):
                if e in seen:
                    slots.append(seen[e])
                    continue
                seen[e] = s
                slots.append((e, self._take(e, gate, "weight"), self._take(e, up, "weight"),
                              self._take(e, down, "weight")))
            return stack_int4_experts(scheme, self.prefix, slots)
        parts: dict[str, list[torch.Tensor]] = {"w13": [], "w13_scale": [], "w2": [], "w2_scale": []}
        first: dict[int, int] = {}
        for s, e in enumerate(self.slot_experts):
            if e in first:
                for v in parts.values():
                    v.append(v[first[e]])
                continue
            first[e] = s
            parts["w13"].append(torch.cat([self._take(e, gate, "weight"), self._take(e, up, "weight")]))
            parts["w13_scale"].append(torch.cat([self._take(e, gate, "scale"), self._take(e, up, "scale")]))
            parts["w2"].append(self._take(e, down, "weight"))
            parts["w2_scale"].append(self._take(e, down, "scale"))
        stacked = {k: torch.stack(v).contiguous() for k, v in parts.items()}
        for k in ("w13_scale", "w2_scale"):
            if stacked[k].dtype != torch.uint8:
                stacked[k] = stacked[k].float()
        if stacked["w13_scale"].dtype != stacked["w2_scale"].dtype:
            raise ModelLoadError(f"{self.prefix}.experts: the scales mix e8m0 and float storage")
        return QuantizedExperts(scheme, stacked["w13"], stacked["w13_scale"], stacked["w2"],
                                stacked["w2_scale"])
