"""int4 weight-only checkpoints (AWQ, GPTQ) in their exact packing, and the torch reference that dequantizes them.

Both store 4-bit unsigned values q in int32 words (8 per word), a zero point z and an fp16 scale s
per (group of 128 input channels, output channel); the weight is W[n, k] = (q - z) * s.

- AWQ (AutoAWQ's GEMM layout, `version: gemm`): qweight int32 [K, N/8] and qzeros int32 [K/G, N/8]
  packed along the OUTPUT dim with AWQ's interleaved order: nibble slot i (bits 4i..4i+3) of word c
  holds column 8c + AWQ_ORDER[i], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7); scales fp16 [K/G, N]. The
  group of input row k is k // G.
- GPTQ (AutoGPTQ's layout): qweight int32 [K/8, N] packed along the INPUT dim in order (row 8i + j
  in slot j of word i); qzeros int32 [K/G, N/8] packed along the output dim in order; scales fp16
  [K/G, N]; g_idx int32 [K], the group of each input row (act-order checkpoints permute it). The
  original GPTQ format (`checkpoint_format: gptq`, "v1") stores z - 1, so the zero point is the
  stored value + 1; `gptq_v2` stores z itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.errors import ModelLoadError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# column j of a word sits in nibble slot AWQ_SLOT[j] (the inverse permutation of AWQ_ORDER)
AWQ_SLOT = tuple(AWQ_ORDER.index(j) for j in range(8))
INT4_GROUP = 128
PACK = 8


@dataclass
class Int4Weight:
    """The packed tensors of one int4 linear, as the checkpoint stores them (see the module docstring).

    method: "awq" | "gptq". zero_offset: added to the stored zero point (1 for GPTQ v1, else 0).
    in_features / out_features: the layer's K / N (checked against the tensors by `check`).
    num_groups: the groups qzeros / scales hold where that is not K / G: a tensor-parallel rank's row part of a GPTQ
    act-order record keeps every group's (its input rows reference groups across the whole K; `part`)."""

    method: str
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None = None
    group_size: int = INT4_GROUP
    zero_offset: int = 0
    num_groups: int | None = None

    @property
    def scheme(self) -> str:
        return f"int4_{self.method}"

    def check(self, name: str, out_features: int, in_features: int) -> None:
        """Every tensor's shape and dtype against the layer's [out, in]; ModelLoadError naming the tensor."""
        k, n, g = in_features, out_features, self.group_size
        if k % g or n % PACK or (self.method == "gptq" and k % PACK):
            raise ModelLoadError(f"{name}: int4 {self.method} needs in_features % {g} == 0 and out_features % 8 == 0"
                                 f" (got [{n}, {k}])")
        groups = k // g
        if self.num_groups is not None:
            if self.method != "gptq" or self.g_idx is None or self.num_groups < groups:
                raise ModelLoadError(f"{name}: num_groups {self.num_groups} is for a GPTQ act-order row part (g_idx "
                                     f"given, at least the part's {groups} groups)")
            groups = self.num_groups
        want = {"awq": {"qweight": (k, n // PACK), "qzeros": (groups, n // PACK), "scales": (groups, n)},
                "gptq": {"qweight": (k // PACK, n), "qzeros": (groups, n // PACK), "scales": (groups, n)}}
        if self.method not in want:
            raise ModelLoadError(f"{name}: unknown int4 method {self.method!r} (known: awq, gptq)")
        for field, shape in want[self.method].items():
            t = getattr(self, field)
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"{name}.{field} has shape {tuple(t.shape)}, expected {shape}")
        for field in ("qweight", "qzeros"):
            if getattr(self, field).dtype != torch.int32:
                raise ModelLoadError(f"{name}.{field} must be int32, got {getattr(self, field).dtype}")
        if self.method == "gptq":
            if self.g_idx is None:
                raise ModelLoadError(f"{name}.g_idx is missing (GPTQ checkpoints store it)")
            if tuple(self.g_idx.shape) != (k,):
                raise ModelLoadError(f"{name}.g_idx has shape {tuple(self.g_idx.shape)}, expected ({k},)")
            if int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= groups:
                raise ModelLoadError(f"{name}.g_idx holds groups outside [0, {groups})")

    @property
    def act_order(self) -> bool:
        """Whether g_idx is GPTQ act-order's (desc_act): not arange(K) // G."""
        if self.g_idx is None:
            return False
        k = self.g_idx.numel()
        return not torch.equal(self.g_idx.long(), torch.arange(k, device=self.g_idx.device) // self.group_size)

    def part(self, dim: int, start: int, stop: int, name: str) -> Int4Weight:
        """This tensor-parallel rank's slice of the linear, [out, in] convention: dim 0 = output channels
        [start, stop) (a column-parallel layer), dim 1 = input channels (row-parallel). The packed words, zero
        points and scales are cut so the part dequantizes to the same slice of the whole. ModelLoadError naming
        the layer where the cut would split a packed int32 word (8 values) or a quantization group (vLLM's GPTQ /
        AWQ linears refuse such a part too). A row part of a GPTQ act-order record keeps every group's zero points
        and scales (`num_groups`) and its rows' g_idx as stored: its input rows reference groups across the whole K
        (vLLM's GPTQ linears keep them whole on each rank the same way); its rows must still be whole groups' worth
        (a multiple of G at a multiple of G), so a kernel's K loop over it is the whole record's."""
        if dim not in (0, 1) or not 0 <= start < stop:
            raise ValueError(f"{name}: bad part dim {dim} [{start}:{stop}]")
        g = self.group_size
        if dim == 0:
            if start % PACK or stop % PACK:
                raise ModelLoadError(f"{name}: int4 {self.method} output channels [{start}:{stop}] split a packed "
                                     f"int32 word of {PACK} (this rank's part must be a multiple of {PACK})")
            cols, words = slice(start, stop), slice(start // PACK, stop // PACK)
            qweight = self.qweight[:, words] if self.method == "awq" else self.qweight[:, cols]
            return Int4Weight(self.method, qweight.contiguous(), self.qzeros[:, words].contiguous(),
                              self.scales[:, cols].contiguous(), self.g_idx, g, self.zero_offset, self.num_groups)
        if start % g or stop % g:
            raise ModelLoadError(f"{name}: int4 {self.method} input channels [{start}:{stop}] split a quantization "
                                 f"group of {g} (this rank's part must be a multiple of the group size)")
        rows = slice(start, stop)
        if self.act_order:  # every group's zero points and scales, the rows' groups as stored
            g_idx = self.g_idx[rows].contiguous()
            if torch.equal(g_idx.long(), torch.arange(stop - start, device=g_idx.device) // g):
                # rows that are groups 0.. in order: a plain part of those groups (so every consumer of a part
                # with num_groups meets a real act-order g_idx)
                return Int4Weight(self.method, self.qweight[start // PACK:stop // PACK].contiguous(),
                                  self.qzeros[:(stop - start) // g].contiguous(),
                                  self.scales[:(stop - start) // g].contiguous(), g_idx, g, self.zero_offset)
            return Int4Weight(self.method, self.qweight[start // PACK:stop // PACK].contiguous(), self.qzeros,
                              self.scales, g_idx, g, self.zero_offset, self.num_groups or self.scales.shape[0])
        groups = slice(start // g, stop // g)
        qweight = self.qweight[rows] if self.method == "awq" else self.qweight[start // PACK:stop // PACK]
        g_idx = None if self.g_idx is None else (self.g_idx[rows] - start // g).contiguous()
        return Int4Weight(self.method, qweight.contiguous(), self.qzeros[groups].contiguous(),
                          self.scales[groups].contiguous(), g_idx, g, self.zero_offset)

    def reorder_inputs(self, perm: torch.Tensor, name: str) -> Int4Weight:
        """GPTQ: the record whose input channel j is this one's channel perm[j] (its g_idx entry with it), the groups'
        zero points and scales unchanged. Sorting an act-order record's inputs by group (act_order_permutation)
        gives a plain record of contiguous groups: what a routed expert's down projection needs before a
        tensor-parallel cut of its inputs (models/layers/experts.py)."""
        if self.method != "gptq" or self.g_idx is None or self.num_groups is not None:
            raise ModelLoadError(f"{name}: only a whole GPTQ record's input channels can be reordered")
        q = unpack_gptq_rows(self.qweight)[perm.to(self.qweight.device)]  # [K, N]
        qweight = _pack_nibbles(q.t()).t().contiguous()
        return Int4Weight("gptq", qweight, self.qzeros, self.scales, self.g_idx[perm.to(self.g_idx.device)].contiguous(),
                          self.group_size, self.zero_offset)

    def reorder_outputs(self, idx: torch.Tensor, name: str) -> Int4Weight:
        """GPTQ: the record whose output channel j is this one's channel idx[j] (a permutation of all of them), its
        g_idx (of the inputs) unchanged: a routed expert's gate / up rows put in its down projection's sorted order."""
        if self.method != "gptq":
            raise ModelLoadError(f"{name}: only a GPTQ record's output channels are reordered here")
        idx = idx.to(self.qweight.device)
        zeros = unpack_gptq_cols(self.qzeros)[:, idx]
        return Int4Weight("gptq", self.qweight[:, idx].contiguous(), _pack_nibbles(zeros), self.scales[:, idx].contiguous(),
                          self.g_idx, self.group_size, self.zero_offset, self.num_groups)

    def groups_of_rows(self) -> torch.Tensor:
        """int32 [K]: the group of each input row (g_idx for GPTQ, k // G for AWQ)."""
        if self.g_idx is not None:
            return self.g_idx.to(torch.int32)
        k = self.qweight.shape[0]
        return (torch.arange(k, device=self.qweight.device) // self.group_size).to(torch.int32)


def _nibbles(words: torch.Tensor, slots: tuple[int, ...]) -> torch.Tensor:
    """int32 [..., W] -> int32 [..., W * 8]: output position 8w + j is nibble slots[j] of word w."""
    shifts = torch.tensor([4 * s for s in slots], dtype=torch.int32, device=words.device)
    vals = (words.unsqueeze(-1) >> shifts) & 0xF
    return vals.reshape(*words.shape[:-1], words.shape[-1] * PACK)


def _pack_nibbles(vals: torch.Tensor) -> torch.Tensor:
    """int [..., 8W] in 0..15 -> int32 [..., W]: nibble j of word w holds vals[..., 8w + j] (GPTQ's order; the inverse
    of `_nibbles` with slots 0..7)."""
    v = vals.to(torch.int64).reshape(*vals.shape[:-1], -1, PACK)
    shifts = torch.arange(PACK, dtype=torch.int64, device=vals.device) * 4
    words = (v << shifts).sum(-1)  # (disjoint bit fields: the sum is their OR)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ qweight / qzeros int32 [R, N/8] -> int32 [R, N] in natural column order."""
    return _nibbles(packed, AWQ_SLOT)


def unpack_gptq_rows(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight int32 [K/8, N] -> int32 [K, N] (row 8i + j = nibble j of row i)."""
    vals = _nibbles(qweight.t().contiguous(), tuple(range(PACK)))  # [N, K]
    return vals.t().contiguous()


def unpack_gptq_cols(qzeros: torch.Tensor) -> torch.Tensor:
    """GPTQ qzeros int32 [G, N/8] -> int32 [G, N] (column 8c + j = nibble j of word c)."""
    return _nibbles(qzeros, tuple(range(PACK)))


def int4_values(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [K, N], zeros fp32 [G, N] with the offset applied, scales fp32 [G, N])."""
    if w.method == "awq":
        q, z = unpack_awq(w.qweight), unpack_awq(w.qzeros)
    else:
        q, z = unpack_gptq_rows(w.qweight), unpack_gptq_cols(w.qzeros)
    return q, z.float() + w.zero_offset, w.scales.float()


def dequant_int4(w: Int4Weight) -> torch.Tensor:
    """fp32 [out, in] = (q[k, n] - z[g(k), n]) * s[g(k), n], transposed to the [out, in] of a linear."""
    q, z, s = int4_values(w)
    g = w.groups_of_rows().long()
    return ((q.float() - z[g]) * s[g]).t().contiguous()


# ------------------------------------------------------------ routed experts (QuantizedExperts "int4_awq" / "int4_gptq")


def int4_expert_rows(w: Int4Weight, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert projection's checkpoint record -> the QuantizedExperts int4 layout (backend/quantized_experts.py):
    (q uint8 [N, K/2], two per byte, low nibble = even input channel; zeros uint8 [N, K/G], offset applied;
    scales [N, K/G] as stored). The same for AWQ and GPTQ: both become row-major nibbles along K, so a kernel
    reads an expert's [rows, K-tile] like V4's fp4 bytes. A GPTQ g_idx other than k // G (act-order) is refused
    here: the layout's groups are contiguous runs of G inputs. (The routed experts take act-order through
    `int4_expert_values`, models/layers/quant/int4_experts.py.)"""
    qt, zeros, scales, g_idx = int4_expert_values(w)
    if g_idx is not None:
        raise ModelLoadError(f"{name}.g_idx is not arange(in_features) // {w.group_size} (a GPTQ act-order / "
                             "desc_act checkpoint): this layout runs contiguous groups only")
    return pack_int4_rows(qt), zeros, scales


def int4_expert_values(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One projection's record as unpacked rows: (q uint8 [N, K] in 0..15, zeros uint8 [N, K/G] offset applied,
    scales [N, K/G] as stored, g_idx int32 [K] where it is not k // G (act-order), else None)."""
    q, z, _ = int4_values(w)  # q int32 [K, N], z fp32 [G, N] (offset applied)
    g_idx = w.g_idx.to(torch.int32).contiguous() if w.act_order else None
    return (q.t().to(torch.uint8).contiguous(), z.t().round().to(torch.uint8).contiguous(), w.scales.t().contiguous(),
            g_idx)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> [N, K/2], two per byte, low nibble = the even input channel."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4_rows: uint8 [N, K/2] -> [N, K] values 0..15."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def act_order_permutation(g_idx: torch.Tensor, group: int, name: str) -> torch.Tensor:
    """The input channels of an act-order projection sorted by group (a stable sort): int64 [K], perm, such that
    channel perm[j] is in group j // G, every group then a contiguous run of G channels, as GPTQ's act-order assigns
    them (it quantizes the channels in its permuted order, G at a time). ModelLoadError naming the tensor where a
    group does not hold exactly G channels."""
    perm = torch.argsort(g_idx.long(), stable=True)
    want = torch.arange(g_idx.numel(), device=g_idx.device) // group
    if not torch.equal(g_idx.long()[perm], want):
        raise ModelLoadError(f"{name}.g_idx: each group must hold exactly {group} input channels (GPTQ act-order)")
    return perm


def dequant_int4_rows(packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int,
                      g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of the int4 experts layout: fp32 [N, K] = (q - zero) * scale, per row and group of inputs
    (input channel k in group k // G, or g_idx[k] where given: an act-order gate / up projection)."""
    n = packed.shape[0]
    q = unpack_int4_rows(packed).float()
    if g_idx is not None:
        g = g_idx.long()
        return (q - zeros.float()[:, g]) * scales.float()[:, g]
    if q.shape[1] == zeros.shape[1] * group:  # whole groups: zero and scale broadcast (no expanded copies; the
        # same products, ~1.8x faster per expert on this CPU, where the cpu MoE dequantizes each expert per call)
        grouped = (q.view(n, -1, group) - zeros.float()[:, :, None]) * scales.float()[:, :, None]
        return grouped.view(n, -1)
    z = zeros.float().repeat_interleave(group, dim=1)
    s = scales.float().repeat_interleave(group, dim=1)
    return (q - z) * s
