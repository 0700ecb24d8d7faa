"""What a backend can do (`BackendCaps`) and what the engine is about to ask of it (`FeatureRequest`).

The engine checks a `FeatureRequest` against the caps at start-up and refuses with every reason
at once: a feature a backend lacks is never silently replaced by something else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class BackendCaps:
    """What a backend can do. Defaults are the cautious answer.

    quant_schemes: linear schemes it runs ("none"; "fp8_block": 128x128 e4m3 blocks + scale_inv).
    model_types: config.json model_type values whose ops it implements (empty: no restriction).
    batch_invariant: a row's results are bitwise the same whatever else is in its batch, however its prompt
        was chunked, prefill or decode (after `Backend.enable_batch_invariance`).
    batch_invariant_model_types: the model types that guarantee covers (empty: all of model_types).
    batch_invariant_note: why not, when batch_invariant is False (shown when it is asked for).
    graph_capture: it supplies a graph runner (`Backend.make_graph_runner`) for decode steps.
    graph_decode_rows: its decode path writes every row's KV before any row attends, so several decode rows of
        one sequence (positions c, c + 1, ...) compute causal attention exactly: a step with prompt chunks may
        replay the decode graphs as one decode row per token (worker/decode_rows.py).
    max_tensor_parallel_size: the most devices its communicator spans.
    kv_cache_dtypes: KV-cache storage it reads and writes: "auto" (the compute dtype) and "fp8_e4m3" (the
        MLA latent cache in float8_e4m3fn with a per-layer scale, docs/quantization.md "fp8 KV cache").
    moe_quant_schemes: routed-expert schemes its MoE op runs quantized (`MoEOp.load_quantized_experts`:
        "fp8_block", "fp4", "int4_awq", "int4_gptq"); others are densified at load (docs/quantization.md "Quantized routed experts").
    fused_act_quant: its fp8 W8A8 linears and MoE read activations quantized by the op before them (the norm's /
        SiLU-and-mul's one pass over each row, `Backend.rms_norm_fp8` / `silu_and_mul_fp8`, where their
        `takes_fp8_act` says so): what the config file's `fuse_quant_dequant: true` asks for.
    """

    device_type: str = "cpu"
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    kv_block_sizes: tuple[int, ...] = (16,)
    quant_schemes: tuple[str, ...] = ("none",)
    model_types: tuple[str, ...] = ()
    batch_invariant: bool = False
    batch_invariant_model_types: tuple[str, ...] = ()
    batch_invariant_note: str = ""
    graph_capture: bool = False
    graph_decode_rows: bool = False
    max_tensor_parallel_size: int = 1
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    moe_quant_schemes: tuple[str, ...] = ()
    fused_act_quant: bool = False

    def unsupported(self, req: "FeatureRequest") -> list[str]:
        """Reasons this backend cannot serve `req`; empty means it can."""
        reasons: list[str] = []
        if req.dtype is not None and req.dtype not in self.dtypes:
            names = ", ".join(dtype_name(d) for d in self.dtypes)
            reasons.append(f"dtype {dtype_name(req.dtype)} not supported (supported: {names})")
        if req.quantization is not None and req.quantization not in self.quant_schemes:
            reasons.append(f"quantization {req.quantization!r} not supported (supported: {', '.join(self.quant_schemes)})")
        if req.model_type is not None and self.model_types and req.model_type not in self.model_types:
            reasons.append(f"model_type {req.model_type!r} not supported (supported: {', '.join(self.model_types)})")
        if req.tensor_parallel_size > self.max_tensor_parallel_size:
            reasons.append(
                f"tensor_parallel_size x data_parallel_size = {req.tensor_parallel_size} devices exceeds this "
                f"backend's maximum of {self.max_tensor_parallel_size}"
            )
        if req.batch_invariant and not self.batch_invariant:
            note = f": {self.batch_invariant_note}" if self.batch_invariant_note else ""
            reasons.append(f"batch-invariant inference (DEEPINFER_BATCH_INVARIANT=1) is not supported{note}")
        elif (req.batch_invariant and req.model_type is not None and self.batch_invariant_model_types
              and req.model_type not in self.batch_invariant_model_types):
            reasons.append(f"batch-invariant inference covers model_type {', '.join(self.batch_invariant_model_types)}"
                           f" here, not {req.model_type!r}")
        if req.kv_cache_dtype not in self.kv_cache_dtypes:
            reasons.append(f"KV cache dtype {req.kv_cache_dtype!r} (--kv-cache-dtype) not supported (supported: "
                           f"{', '.join(self.kv_cache_dtypes)})")
        elif req.kv_cache_dtype != "auto" and req.batch_invariant:
            reasons.append(f"KV cache dtype {req.kv_cache_dtype!r} with batch-invariant inference: the invariant "
                           "MLA ops read only a compute-dtype cache")
        if req.kv_block_size is not None and req.kv_block_size not in self.kv_block_sizes:
            reasons.append(f"KV block size {req.kv_block_size} not supported (supported: {self.kv_block_sizes})")
        if req.moe_quantization is not None and req.moe_quantization not in self.moe_quant_schemes:
            reasons.append(f"quantization_config method {req.moe_quantization}: this backend's MoE op does not run "
                           f"{req.moe_quantization} experts quantized (it runs: "
                           f"{', '.join(self.moe_quant_schemes) or 'none'})")
        if req.fuse_act_quant and not self.fused_act_quant:
            reasons.append("quantization_config fuse_quant_dequant true: this backend's fp8 W8A8 linears quantize "
                           "their activations in their own kernels (no fused act quant); set it false or leave it out")
        return reasons


@dataclass(frozen=True)
class FeatureRequest:
    """What the engine is about to ask of a backend, checked at start-up."""

    dtype: torch.dtype | None = None
    quantization: str | None = None
    model_type: str | None = None
    tensor_parallel_size: int = 1  # every device of the job: tensor_parallel_size x data_parallel_size
    batch_invariant: bool = False
    kv_block_size: int | None = None
    kv_cache_dtype: str = "auto"  # canonical (EngineConfig.kv_cache_storage()): "auto" | "fp8_e4m3"
    fuse_act_quant: bool = False  # the config file's fuse_quant_dequant: true (BackendCaps.fused_act_quant)
    moe_quantization: str | None = None  # the config file's routed-expert scheme (fp4; BackendCaps.moe_quant_schemes)
