"""The `cpu` backend: torch on the host, with batched CPU paths for the MLA and MoE layer ops.

Every small op and the linears are the torch-native ones (deepinfer.backend.native), the reference
for the other backends. Two layer ops have CPU-specific paths beside the native ones, because on
a CPU with small models the native ops' per-request / per-expert loops are the step's cost:
`ops_mla.CPUMLAAttention` (all decode rows of a step in one absorbed attention) and
`ops_moe.CPUMoE` (small batches as two dense GEMMs over every expert). The conformance suite
checks both against the native ops (`deepinfer check --device cpu`); DEEPINFER_CPU_FAST_OPS=0
runs the native ones instead.

Threads: the backend sets torch's intra-op threads when it is built (threads.py, docs/performance.md
"CPU threads").
"""

from __future__ import annotations

import logging

import torch

from deepinfer import envs
from deepinfer.backend import (
    LINEAR_SCHEMES,
    Backend,
    BackendCaps,
    Communicator,
    MLASpec,
    MoESpec,
    NativeOps,
    TorchDistributedCommunicator,
    host_memory_info,
)
from deepinfer.backends.cpu import invariant
from deepinfer.backends.cpu.ops_linear import TransposedWeightLinear
from deepinfer.backends.cpu.ops_mla import CPUMLAAttention, PlanCache
from deepinfer.backends.cpu.ops_moe import CPUMoE
from deepinfer.backends.cpu.threads import configure_threads

logger = logging.getLogger(__name__)

DEFAULT_MOE_DENSE_MAX_WORK = 16 * 1024 * 1024  # tokens x experts x moe_inter x hidden; see ops_moe.py

LINEAR_IMPL = "native, weight stored transposed ([in, out]: MKL's NN GEMM)"
MLA_IMPL = "cpu: decode rows batched (one absorbed attention per layer); prefill native"
MOE_IMPL = "cpu: dense GEMMs over every expert (+ shared) for small batches; native loop above, fp16"


class CPUBackend(NativeOps, Backend):
    """Torch on the host CPU.

    batch_invariant (V2 / V3 family): the default ops are not (MKL picks its GEMM kernel from the row
    count, torch's elementwise loops round the tail differently); after `enable_batch_invariance` the
    backend hands out invariant.py's ops instead, at a cost (docs/determinism.md).
    """

    name = "cpu"

    def __init__(self) -> None:
        self._caps = BackendCaps(
            device_type="cpu",
            dtypes=(torch.float32, torch.bfloat16, torch.float16),
            kv_block_sizes=(16,),
            # every scheme as the reference: weights dequantized at load, computed in the dtype (fp8_w8a8 also
            # quantizes the activations per token per 128 channels first); docs/quantization.md
            quant_schemes=LINEAR_SCHEMES,
            moe_quant_schemes=("fp8_block", "fp8_w8a8", "fp4", "int4_awq", "int4_gptq"),  # ops_moe: the native per-expert dequant loop
            model_types=("deepseek_v2", "deepseek_v3", "deepseek_v4"),
            batch_invariant=True,  # with enable_batch_invariance: invariant.py
            batch_invariant_model_types=("deepseek_v2", "deepseek_v3"),  # V4's ops have no invariant forms yet
            graph_capture=False,
            # gloo spans any number of processes (one per rank; docs/parallelism.md); 64 is a sanity bound
            max_tensor_parallel_size=64,
            kv_cache_dtypes=("auto", "fp8_e4m3"),  # fp8: the MLA latent cache, quantized / dequantized in ops_mla
        )
        self.threads = configure_threads()
        self.fast_ops = envs.CPU_FAST_OPS.get()
        work = envs.CPU_MOE_DENSE_MAX_WORK.get()
        self.moe_dense_max_work = DEFAULT_MOE_DENSE_MAX_WORK if work is None else work
        self._mla_plans = PlanCache()  # one decode plan per step, shared by every layer's MLA op

    @property
    def caps(self) -> BackendCaps:
        return self._caps

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> tuple[int, int]:
        return host_memory_info()

    def make_communicator(self, group, name: str) -> Communicator:
        """torch.distributed over `group`, which must run on gloo (the CPU's transport; NCCL would refuse CPU
        tensors deep inside torch)."""
        return TorchDistributedCommunicator(group, name, expect_transport="gloo")

    def enable_batch_invariance(self) -> None:
        """From now on the ops are invariant.py's; torch runs one intra-op thread (its parallel elementwise
        loops split at size-dependent points, see invariant.py)."""
        if self.threads != 1:
            logger.warning("batch_invariant: the cpu backend runs one intra-op thread (was %d)", self.threads)
            torch.set_num_threads(1)
            self.threads = 1
        super().enable_batch_invariance()

    def silu_and_mul(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        if self.batch_invariance_enabled:
            return invariant.silu_and_mul(x, limit)
        return super().silu_and_mul(x, limit)

    def linear_method(self, scheme: str):
        if self.batch_invariance_enabled:
            return invariant.InvariantLinear(super().linear_method(scheme))
        method = super().linear_method(scheme)
        return TransposedWeightLinear(method) if self.fast_ops else method

    def make_mla_attention(self, spec: MLASpec):
        if self.batch_invariance_enabled:
            return invariant.InvariantMLAAttention(spec)
        if not self.fast_ops:
            return super().make_mla_attention(spec)
        return CPUMLAAttention(spec, self._mla_plans)

    def make_moe(self, spec: MoESpec):
        if self.batch_invariance_enabled:
            return invariant.InvariantMoE(spec)
        if not self.fast_ops:
            return super().make_moe(spec)
        return CPUMoE(spec, route_fn=self.route, silu_and_mul=self.silu_and_mul,
                      dense_max_work=self.moe_dense_max_work)

    def op_coverage(self) -> dict[str, str]:
        cov = super().op_coverage()
        if self.batch_invariance_enabled:
            cov.update({"mla_attention": "cpu: batch-invariant (absorbed, fixed context blocks)",
                        "moe": "cpu: batch-invariant (per-expert chunked GEMMs)", "silu_and_mul": "cpu: batch-invariant"})
            for scheme in LINEAR_SCHEMES:
                cov[f"linear:{scheme}"] = "cpu: batch-invariant (row-chunked GEMM)"
        elif self.fast_ops:
            cov["mla_attention"] = MLA_IMPL
            cov["moe"] = MOE_IMPL
            for scheme in LINEAR_SCHEMES:
                cov[f"linear:{scheme}"] = LINEAR_IMPL
        return cov
