"""The nvidia backend's quantized linear methods: weights stay quantized in memory, the kernels dequantize.

- `TritonFp8W8A8Linear` ("fp8_w8a8"): e4m3 weight + fp32 128x128 scales kept as loaded (a dense weight
  is quantized online first); each call quantizes x per token per 128 channels (fp8_act_quant.py, or
  inside the GEMM at decode-sized M) and runs the block-scaled fp8 GEMM (fp8_gemm.py).
- `TritonInt4Linear` ("int4_awq" / "int4_gptq"): the checkpoint's packed int4 repacked once into the
  kernel's layout (int4_gemm.py), dequantized in the GEMM's inner loop (decode) or dequantized to the
  compute dtype for cuBLAS (prefill-sized M).

`dense_weight` (for ops that fold a weight, e.g. MLA's absorbed kv_b_proj) dequantizes on demand.
"""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.backend import (
    Fp8Act,
    Int4Weight,
    LinearMethod,
    dequant_fp8_block,
    int4_values,
    pack_int4_rows,
    quantize_weight_fp8_block,
    unpack_int4_rows,
)
from deepinfer.backends.nvidia.quant.fp8_cublas import k4_scales
from deepinfer.errors import ModelLoadError

FP8 = torch.float8_e4m3fn


def _set(layer: torch.nn.Module, name: str, t: torch.Tensor | None) -> None:
    setattr(layer, name, None if t is None else torch.nn.Parameter(t.contiguous(), requires_grad=False))


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class TritonFp8W8A8Linear(LinearMethod):
    scheme = "fp8_w8a8"

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        w = layer.weight.detach()
        s = getattr(layer, "weight_scale_inv", None)
        if w.dtype == FP8:
            if s is None:
                raise ModelLoadError("fp8 weight has no weight_scale_inv (128x128 block scales)")
            if tuple(s.shape) != (-(-w.shape[0] // 128), -(-w.shape[1] // 128)):
                raise ModelLoadError(f"fp8 weight_scale_inv has shape {tuple(s.shape)} for a {tuple(w.shape)} weight")
        elif s is not None:
            raise ModelLoadError(f"weight_scale_inv given for a {w.dtype} weight; expected float8_e4m3fn")
        else:
            w, s = quantize_weight_fp8_block(w)  # online quantization of a bf16 / fp16 / fp32 weight
        _set(layer, "weight", w)
        _set(layer, "weight_scale_inv", s.float())
        layer.weight_scale_k4 = k4_scales(layer.weight_scale_inv.detach())  # what cuBLAS's block-scaled GEMM reads
        bias = getattr(layer, "bias", None)
        if bias is not None:
            _set(layer, "bias", bias.detach().to(compute_dtype))
        layer.compute_dtype = compute_dtype

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8
        from deepinfer.backends.nvidia.quant.fp8_cublas import blockscaled_linear, use_cublas
        from deepinfer.backends.nvidia.quant.fp8_gemm import fp8_block_gemm, fused_act_quant

        x2 = _flat(x)
        fused = fused_act_quant(x2.shape[0])
        bias = getattr(layer, "bias", None)
        if use_cublas(x2, layer.weight, fused):  # larger M: cuBLAS's block-scaled fp8 kernels (fp8_cublas.py)
            y = blockscaled_linear(x2, layer.weight, layer.weight_scale_k4, x.dtype, bias)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        # decode-sized M: one launch, the GEMM quantizes x as it loads it (the same values as the separate kernel)
        xq, xs = (x2, None) if fused else quantize_act_fp8(x2)
        y = fp8_block_gemm(xq, xs, layer.weight, layer.weight_scale_inv, x.dtype, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def takes_fp8_act(self, layer: torch.nn.Module, num_tokens: int) -> bool:
        """Above the size whose GEMM quantizes x on load, x is quantized apart anyway: the norm before may do it."""
        from deepinfer.backends.nvidia.quant.fp8_gemm import fused_act_quant

        return not fused_act_quant(num_tokens)

    def apply_fp8_act(self, layer: torch.nn.Module, act: Fp8Act) -> torch.Tensor:
        """apply on activations that came quantized: cuBLAS (column-major scales, padded rows) or the Triton GEMM
        (row-major scales) on act's e4m3 values, the products apply gives for their compute-dtype values."""
        from deepinfer.backends.nvidia.quant.fp8_cublas import blockscaled_mm, use_cublas
        from deepinfer.backends.nvidia.quant.fp8_gemm import fp8_block_gemm

        m, dtype = act.rows, layer.compute_dtype
        bias = getattr(layer, "bias", None)
        if use_cublas(act.q, layer.weight, False):
            return blockscaled_mm(act.q, act.s_cm, m, layer.weight, layer.weight_scale_k4, dtype, bias)
        return fp8_block_gemm(act.q[:m], act.s[:m], layer.weight, layer.weight_scale_inv, dtype, bias)

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        return dequant_fp8_block(layer.weight, layer.weight_scale_inv).to(layer.compute_dtype)


class TritonInt4Linear(LinearMethod):
    """int4 weight-only for AWQ and GPTQ; `method` picks which packing process_weights expects. Both are repacked
    once into int4_gemm.py's row layout (the routed experts' layout): uint8 [N, K/2], zeros / scales [N, K/G].

    A GPTQ act-order weight (g_idx a permutation of k // G, G channels a group) has its columns sorted by group
    (`perm_k`: the input channel of each column; DEEPINFER_INT4_ACT_ORDER_SORT, on by default): the kernels then read
    contiguous groups (the CUDA GEMVs too, which take no g_idx) and `apply` gathers x's columns in that order, one
    index_select (Marlin's approach; quant/act_order.py does the same for the routed experts). On an H100 (session
    33) a batch-1 step of a GPTQ act-order V2-Lite copy ran 5.41 ms with the experts sorted and these linears still
    reading g_idx, against 1.79 for AWQ. A row part of an act-order record that keeps every group's scales (tensor
    parallelism) is not sorted: its groups are not whole there; it keeps g_idx_k, gathered per channel."""

    def __init__(self, method: str):
        self.method = method
        self.scheme = f"int4_{method}"

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        w = getattr(layer, "int4", None)
        if not isinstance(w, Int4Weight) or w.method != self.method:
            raise ModelLoadError(f"the {self.scheme} linear method needs the layer's packed {self.method} tensors "
                                 f"(layer.int4), got {getattr(w, 'method', type(w).__name__)}")
        q, z, _ = int4_values(w)  # q [K, N] in 0..15, zeros [K/G, N] with the offset applied
        k = q.shape[0]
        qt = q.t().to(torch.uint8)
        _set(layer, "qweight_nk", qt[:, 0::2] | (qt[:, 1::2] << 4))  # two channels a byte, the even one low
        _set(layer, "zeros_ng", z.t().round().to(torch.uint8))
        _set(layer, "scales_ng", w.scales.t())  # as stored (fp16 in AWQ / GPTQ): read in fp32 by the kernel
        g = w.groups_of_rows()
        want = torch.arange(k, device=g.device) // w.group_size
        trivial = torch.equal(g.long(), want)
        perm = None
        if not trivial and envs.INT4_ACT_ORDER_SORT.get() and w.num_groups is None:
            order = torch.argsort(g.long(), stable=True)
            if torch.equal(g.long()[order], want):  # G channels a group: the sorted columns are contiguous groups
                perm = order
                _set(layer, "qweight_nk", pack_int4_rows(unpack_int4_rows(layer.qweight_nk)[:, perm]))
        _set(layer, "perm_k", None if perm is None else perm.to(torch.int64))  # act-order, sorted
        _set(layer, "g_idx_k", None if trivial or perm is not None else g.to(torch.int32))  # act-order, as stored
        layer.int4_group = w.group_size
        layer.int4 = None
        layer.weight = None
        bias = getattr(layer, "bias", None)
        if bias is not None:
            _set(layer, "bias", bias.detach().to(compute_dtype))
        layer.compute_dtype = compute_dtype

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from deepinfer.backends.nvidia.quant.int4_gemm import int4_gemm

        xf = _flat(x)
        perm = getattr(layer, "perm_k", None)
        if perm is not None:  # sorted act-order columns: x's channels in the same order
            xf = xf.index_select(1, perm)
        y = int4_gemm(xf, layer.qweight_nk, layer.zeros_ng, layer.scales_ng, layer.g_idx_k, layer.int4_group,
                      getattr(layer, "bias", None))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """[out, in] from the kernel layout: the same (q - z) * s as the reference, in fp32, then rounded."""
        b = layer.qweight_nk
        q = unpack_int4_rows(b).float()
        k = q.shape[1]
        g = layer.g_idx_k.long() if layer.g_idx_k is not None else torch.arange(k, device=b.device) // layer.int4_group
        w = (q - layer.zeros_ng.float()[:, g]) * layer.scales_ng.float()[:, g]
        perm = getattr(layer, "perm_k", None)
        if perm is not None:  # sorted columns back in input order
            w = torch.empty_like(w).index_copy_(1, perm, w)
        return w.to(layer.compute_dtype)
