"""The routed experts' quantized layouts as the contract hands them to a MoE op (`MoEOp.load_quantized_experts`):
the schemes, and the `QuantizedExperts` record with its checks. Apart from backend/layer_ops.py (the ops
themselves) because the record is the one data format every backend and the loader (models/layers/experts.py,
models/layers/quant/int4_experts.py) agree on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.errors import BackendError

MOE_QUANT_SCHEMES = ("fp8_block", "fp8_w8a8", "fp4", "int4_awq", "int4_gptq")
FP8_EXPERT_SCHEMES = ("fp8_block", "fp8_w8a8")  # one stored layout; w8a8 also quantizes the activations
INT4_EXPERT_SCHEMES = ("int4_awq", "int4_gptq")  # one stored layout (below); the name says which checkpoint format
INT4_EXPERT_GROUPS = (32, 64, 128)  # input channels per int4 scale / zero point
# not a scheme: what an op lists beside "int4_gptq" in quantized_expert_schemes() where it reads
# QuantizedExperts.w13_g_idx (GPTQ act-order experts); an op that does not gets such experts densified, so a plugin
# written before the field existed is never handed groups it would ignore
INT4_ACT_ORDER = "int4_gptq_act_order"


@dataclass(frozen=True)
class QuantizedExperts:
    """A MoE layer's routed experts as the checkpoint stores them, stacked per slot, for an op that runs them
    quantized (`MoEOp.load_quantized_experts`); gate rows first, then up rows, as load_experts' w13.

    "fp8_block": w13 [E, 2I, D] / w2 [E, D, I] float8_e4m3fn; w13_scale [E, 2 * ceil(I/128), ceil(D/128)] fp32
      (the gate projection's 128x128 block grid, then the up projection's), w2_scale [E, ceil(D/128), ceil(I/128)].
    "fp8_w8a8": the same tensors; each expert's input (x, and the SiLU-and-mul output before the down projection)
      is quantized to e4m3 per token per 128 channels (backend/native/quant_fp8.py quantize_act_fp8) and the
      product taken on the quantized values, as the fp8_w8a8 linear method does (DeepSeek / DeepGEMM's recipe).
    "fp4" (DeepSeek-V4's routed experts, backend/native/quant_fp4.py): w13 [E, 2I, D/2] / w2 [E, D, I/2] uint8,
      two e2m1 per byte (low nibble first); w13_scale [E, 2I, D/32] / w2_scale [E, D, I/32], one per row per 32
      inputs: uint8 = e8m0 bytes (2^(b - 127)), or fp32.
    "int4_awq" / "int4_gptq" (AWQ / GPTQ checkpoints, repacked at load by backend/native/quant_int4.py
      `int4_expert_rows`, still 4 bits a weight): w13 [E, 2I, D/2] / w2 [E, D, I/2] uint8, two unsigned 4-bit q
      per byte (low nibble = the even input channel); w13_scale [E, 2I, D/G] / w2_scale [E, D, I/G] fp16 (as the
      checkpoint stores them) or fp32, one per row per G = group_size inputs; w13_zeros / w2_zeros uint8 of the
      scales' shapes, the zero point with GPTQ v1's +1 already applied (0..16). W = (q - zero) * scale.
      w13_g_idx (GPTQ act-order only, else None): int32 [E, D], the group of each input channel of an expert's gate
      and up projections (one for both: GPTQ quantizes them from the same inputs), where input channel k of w13
      is in group w13_g_idx[e, k] rather than k // G. An act-order down projection needs none: its input channels
      are sorted by group at load, and the gate and up rows put in the same order, so the SiLU-and-mul output
      arrives in that order (models/layers/quant/int4_experts.py).
    """

    scheme: str
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_zeros: torch.Tensor | None = None  # int4 only
    w2_zeros: torch.Tensor | None = None
    group_size: int = 128  # int4 only: input channels per scale / zero point
    w13_g_idx: torch.Tensor | None = None  # int4 GPTQ act-order only (above)

    @property
    def block(self) -> int:
        """Input channels per scale: 128 (fp8 blocks, also 128 rows), 32 (fp4, per row), group_size (int4)."""
        if self.scheme in INT4_EXPERT_SCHEMES:
            return self.group_size
        return 128 if self.scheme in FP8_EXPERT_SCHEMES else 32

    def check(self, num_experts: int, hidden: int, inter: int) -> None:
        """BackendError naming the tensor whose dtype or shape disagrees with the scheme's layout."""
        if self.scheme not in MOE_QUANT_SCHEMES:
            raise BackendError(f"QuantizedExperts scheme {self.scheme!r} (known: {', '.join(MOE_QUANT_SCHEMES)})")
        if self.w13_g_idx is not None and self.scheme != "int4_gptq":
            raise BackendError(f"QuantizedExperts ({self.scheme}) w13_g_idx is GPTQ act-order's (int4_gptq) only")
        cd = lambda a, b: -(-a // b)  # noqa: E731
        if self.scheme in INT4_EXPERT_SCHEMES:
            self._check_int4(num_experts, hidden, inter)
            return
        if self.scheme in FP8_EXPERT_SCHEMES:
            dt = torch.float8_e4m3fn
            expect = {"w13": (num_experts, 2 * inter, hidden), "w2": (num_experts, hidden, inter),
                      "w13_scale": (num_experts, 2 * cd(inter, 128), cd(hidden, 128)),
                      "w2_scale": (num_experts, cd(hidden, 128), cd(inter, 128))}
        else:
            dt = torch.uint8
            expect = {"w13": (num_experts, 2 * inter, hidden // 2), "w2": (num_experts, hidden, inter // 2),
                      "w13_scale": (num_experts, 2 * inter, hidden // 32), "w2_scale": (num_experts, hidden, inter // 32)}
        for name, shape in expect.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise BackendError(f"QuantizedExperts ({self.scheme}) {name} has shape {tuple(t.shape)}, expected {shape}")
            ok = (t.dtype == dt) if name in ("w13", "w2") else (
                t.dtype == torch.float32 or (self.scheme == "fp4" and t.dtype == torch.uint8))
            if not ok:
                raise BackendError(f"QuantizedExperts ({self.scheme}) {name} has dtype {t.dtype}")

    def _check_int4(self, num_experts: int, hidden: int, inter: int) -> None:
        g = self.group_size
        if g not in INT4_EXPERT_GROUPS or hidden % g or inter % g:
            raise BackendError(f"QuantizedExperts ({self.scheme}) group_size {g}: must be one of "
                               f"{INT4_EXPERT_GROUPS} and divide hidden {hidden} and intermediate {inter}")
        expect = {"w13": (num_experts, 2 * inter, hidden // 2), "w2": (num_experts, hidden, inter // 2),
                  "w13_scale": (num_experts, 2 * inter, hidden // g), "w2_scale": (num_experts, hidden, inter // g),
                  "w13_zeros": (num_experts, 2 * inter, hidden // g), "w2_zeros": (num_experts, hidden, inter // g)}
        for name, shape in expect.items():
            t = getattr(self, name)
            if t is None:
                raise BackendError(f"QuantizedExperts ({self.scheme}) {name} is missing")
            if tuple(t.shape) != shape:
                raise BackendError(f"QuantizedExperts ({self.scheme}) {name} has shape {tuple(t.shape)}, expected {shape}")
            ok = t.dtype in (torch.float16, torch.float32) if name.endswith("_scale") else t.dtype == torch.uint8
            if not ok:
                raise BackendError(f"QuantizedExperts ({self.scheme}) {name} has dtype {t.dtype}")
            if not t.is_contiguous():
                raise BackendError(f"QuantizedExperts ({self.scheme}) {name} must be contiguous")
        gi = self.w13_g_idx
        if gi is not None:
            if gi.dtype != torch.int32 or tuple(gi.shape) != (num_experts, hidden) or not gi.is_contiguous():
                raise BackendError(f"QuantizedExperts ({self.scheme}) w13_g_idx: {gi.dtype} {tuple(gi.shape)}, "
                                   f"expected contiguous int32 {(num_experts, hidden)}")
            if gi.numel() and (int(gi.min()) < 0 or int(gi.max()) >= hidden // g):
                raise BackendError(f"QuantizedExperts ({self.scheme}) w13_g_idx holds groups outside "
                                   f"[0, {hidden // g})")

    def nbytes(self) -> int:
        parts = (self.w13, self.w13_scale, self.w2, self.w2_scale, self.w13_zeros, self.w2_zeros, self.w13_g_idx)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)
