"""`AscendBackend`: NativeOps with the hot path on torch_npu's fused operators.

Built on an NPU normally (torch_npu imported here, lazily, only when the backend is selected). Over the
test-only CPU fake of torch_npu (tests/ascend/fake_torch_npu) it runs on CPU tensors: that is how CI
checks the op wiring; nothing here has run on Ascend hardware (docs/ascend.md).
"""

from __future__ import annotations

import logging

import torch

from deepinfer import envs
from deepinfer.backend import (
    Backend,
    BackendCaps,
    Communicator,
    KVCacheSpec,
    KVLayout,
    LinearMethod,
    MLAAttentionOp,
    MLASpec,
    MoEOp,
    MoESpec,
    NativeOps,
    OpSpec,
    RouterSpec,
    host_memory_info,
)
from deepinfer.backends.ascend import routing, small_ops
from deepinfer.backends.ascend.caps import INT4_CHIPS, INT4_SCHEMES, INT8_CHIPS, INT8_SCHEMES, ascend_caps
from deepinfer.backends.ascend.mla_attention import (
    ROPE_ORDER,
    AscendMLAAttention,
    PermutedRopeNativeMLA,
    fia_mla_reasons,
)
from deepinfer.backends.ascend.moe import AscendMoE
from deepinfer.backends.ascend.runtime import load_runtime
from deepinfer.errors import BackendError

log = logging.getLogger(__name__)
FUSED = {"rms_norm": "npu_rms_norm", "add_rms_norm": "npu_add_rms_norm", "silu_and_mul": "npu_swiglu"}
MLA_IMPL = ("npu_fused_infer_attention_score (paged absorbed decode, TND prefill); latent norm + RoPE + cache "
            "write npu_kv_rmsnorm_rope_cache, q RoPE npu_interleave_rope (interleaved RoPE; else npu_rms_norm + torch "
            "+ npu_scatter_pa_kv_cache); from the hidden states npu_mla_prolog_v3 on decode batches (bf16, "
            "hidden 7168 / 7680, q_lora_rank 1536)")
INT4_IMPL = ("npu_weight_quant_batchmatmul (W4A16: npu_convert_weight_to_int4pack weights, per-group 128 antiquant "
             "scale / offset; GPTQ act-order refused at load)")
INT8_IMPL = ("npu_dynamic_quant (x per token, symmetric int8) + npu_quant_matmul (int8 x int8, per-channel "
             "weight_scale, pertoken_scale, fp16 / bf16 out)")
MOE_IMPL = "npu_moe_init_routing_v2 + npu_grouped_matmul + npu_swiglu + npu_moe_finalize_routing"


class AscendBackend(NativeOps, Backend):
    name = "ascend"

    def __init__(self, device_index: int | None = None) -> None:
        self.runtime = load_runtime(device_index)
        self.npu = self.runtime.module
        self._caps = ascend_caps(self.runtime.chip, on_cpu=self.runtime.fake, version=self.runtime.version)
        # the Triton router runs on an NPU (triton-ascend) or, on the fake, under the interpreter
        self._kernels = not self.runtime.fake or envs.TRITON_INTERPRET.get() == "1"
        # why decode graphs cannot be captured for the models built here (ops whose host-side inputs a
        # capture would freeze, or that were never checked under capture); filled by make_mla / make_moe
        self._graph_blockers: dict[str, None] = {}

    @property
    def caps(self) -> BackendCaps:
        return self._caps

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    # ------------------------------------------------------------ device services

    def memory_info(self) -> tuple[int, int]:
        if self.runtime.fake:
            return host_memory_info()
        return self.npu.npu.mem_get_info(self.device)

    def synchronize(self) -> None:
        self.npu.npu.synchronize(self.device if not self.runtime.fake else None)

    def manual_seed(self, seed: int) -> None:
        self.npu.npu.manual_seed(seed)

    def make_communicator(self, group, name: str) -> Communicator:
        """HCCL over `group` (the engine builds the groups and installs them; `communicator(group)` hands them
        out). On the CPU fake the job runs on gloo, and so does the group."""
        from deepinfer.backends.ascend.communicator import HCCLCommunicator

        return HCCLCommunicator(group, name, transport="gloo" if self.runtime.fake else "hccl")

    # ------------------------------------------------------------ small fused ops

    def rms_norm(self, x, weight, eps):
        if x.dtype not in (torch.float16, torch.bfloat16):
            return super().rms_norm(x, weight, eps)
        return small_ops.rms_norm(self.npu, x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if x.dtype not in (torch.float16, torch.bfloat16):
            return super().add_rms_norm(x, residual, weight, eps)
        return small_ops.add_rms_norm(self.npu, x, residual, weight, eps)

    def silu_and_mul(self, x, limit=None):
        if limit is not None:  # V4's clamped SwiGLU: native (op_impl says so)
            return super().silu_and_mul(x, limit)
        return small_ops.silu_and_mul(self.npu, x)

    def route(self, router_logits: torch.Tensor, spec: RouterSpec, correction_bias=None, token_ids=None,
              tid2eid=None):
        def native():
            return super(AscendBackend, self).route(router_logits, spec, correction_bias, token_ids, tid2eid)

        return routing.route(self.npu, self.runtime.version, self._kernels, router_logits, spec, correction_bias,
                             native)

    # ------------------------------------------------------------ layer ops and layouts

    def kv_cache_layout(self, spec: KVCacheSpec) -> KVLayout:
        """MLA entries the fused ops take (latent 512 | rope 64): two tensors, what they read; else one."""
        comps = dict(spec.components)
        if tuple(spec.entry_shape) == (576,) and comps in ({}, {"latent": 512, "rope": 64}):
            # the rope part as npu_kv_rmsnorm_rope_cache stores it (declared, so join() restores the contract's)
            return KVLayout.split_last(spec, (512, 64), ("latent", "rope"), (None, ROPE_ORDER))
        return KVLayout.single(spec)

    def linear_method(self, scheme: str) -> LinearMethod:
        if scheme in INT4_SCHEMES:
            if self.runtime.chip not in INT4_CHIPS:
                raise BackendError(f"{scheme} on ascend chip {self.runtime.chip!r}: npu_weight_quant_batchmatmul's "
                                   f"int4 weights are documented for {', '.join(INT4_CHIPS)} only")
            from deepinfer.backends.ascend.int4_linear import NPUInt4Linear

            return NPUInt4Linear(self.npu, scheme.removeprefix("int4_"), self.device)
        if scheme in INT8_SCHEMES:
            if self.runtime.chip not in INT8_CHIPS:
                raise BackendError(f"{scheme} on ascend chip {self.runtime.chip!r}: npu_quant_matmul's int8 x int8 "
                                   f"with pertoken_scale is documented for {', '.join(INT8_CHIPS)} only")
            from deepinfer.backends.ascend.int8_linear import NPUInt8W8A8Linear

            return NPUInt8W8A8Linear(self.npu, self.device)
        return super().linear_method(scheme)

    def make_mla_attention(self, spec: MLASpec) -> MLAAttentionOp:
        if fia_mla_reasons(spec):
            self._graph_blockers["native MLA attention reads host-side sequence lengths"] = None
            if spec.cache_entry_dim == 576 and spec.qk_rope_head_dim == 64:  # on the permuted split layout
                return PermutedRopeNativeMLA(spec)
            return super().make_mla_attention(spec)
        return AscendMLAAttention(spec, self.npu)

    def make_moe(self, spec: MoESpec) -> MoEOp:
        if spec.swiglu_limit is not None:
            self._graph_blockers["native MoE (swiglu_limit) was not checked under capture"] = None
            return super().make_moe(spec)
        if routing.route_impl(spec.router, self.runtime.version, self._kernels) != "gating_top_k":
            self._graph_blockers["only npu_moe_gating_top_k routing was checked under capture"] = None
        return AscendMoE(spec, self.npu, route_fn=self.route)

    def make_graph_runner(self, model, caches, block_size, max_model_len, max_num_seqs):
        """Bucketed ACL graphs with per-replay sequence-length updates; a runner that refuses every batch
        (eager, with the reason logged) when an op of this backend's models cannot be captured."""
        from deepinfer.backends.ascend.graph_runner import NPUGraphRunner

        if self._graph_blockers:
            reason = "; ".join(self._graph_blockers)
            log.warning("ascend decode graphs are off for this model: %s", reason)
            return NPUGraphRunner.refusing(model, caches, block_size, reason)
        return NPUGraphRunner.capture(model, caches, block_size, max_model_len, max_num_seqs, self.device)

    # ------------------------------------------------------------ per-op support

    def supports(self, op: OpSpec) -> list[str]:
        """The caps, except that router logits are fp32 by contract (every router takes them)."""
        reasons = super().supports(op)
        if op.op == "route":
            reasons = [r for r in reasons if not r.startswith("dtype")]
        return reasons

    def op_impl(self, op: OpSpec) -> str:
        name, spec = op.op, op.spec
        low = op.dtype in (torch.float16, torch.bfloat16, None)
        if name in ("rms_norm", "add_rms_norm") and low:
            return FUSED[name]
        if name == "silu_and_mul":
            return "native (no torch_npu op for the clamped SwiGLU)" if op.option("limit") is not None \
                else FUSED[name]
        if name == "route" and isinstance(spec, RouterSpec):
            how = routing.route_impl(spec, self.runtime.version, self._kernels)
            return {"gating_top_k": "npu_moe_gating_top_k", "triton": "triton (softmax greedy top-k)"}.get(how, how)
        if name == "mla_attention" and isinstance(spec, MLASpec):
            why = fia_mla_reasons(spec)
            return f"native ({'; '.join(why)})" if why else MLA_IMPL
        if name == "moe" and isinstance(spec, MoESpec):
            if spec.swiglu_limit is not None:
                return "native (swiglu_limit: no torch_npu op)"
            return f"{MOE_IMPL}; route: {self.op_impl(OpSpec('route', None, spec.router))}"
        if name == "linear:fp8_block":
            return "native (dequantized to the compute dtype at load, torch matmul)"
        if name.removeprefix("linear:") in INT4_SCHEMES and self.runtime.chip in INT4_CHIPS:
            return INT4_IMPL
        if name.removeprefix("linear:") in INT8_SCHEMES and self.runtime.chip in INT8_CHIPS:
            return INT8_IMPL
        if name.startswith("linear:"):
            return "native (torch matmul on the NPU)"
        return "native"

    def op_coverage(self) -> dict[str, str]:
        cov = super().op_coverage()
        cov.update({"rms_norm": FUSED["rms_norm"], "add_rms_norm": FUSED["add_rms_norm"],
                    "silu_and_mul": FUSED["silu_and_mul"] + "; native for swiglu_limit",
                    "route": "npu_moe_gating_top_k where its limits allow, triton softmax greedy, else native",
                    "mla_attention": MLA_IMPL + "; native for other shapes",
                    "moe": MOE_IMPL + "; native for swiglu_limit"})
        if self.runtime.chip in INT4_CHIPS:
            cov.update({f"linear:{s}": INT4_IMPL for s in INT4_SCHEMES})
        if self.runtime.chip in INT8_CHIPS:
            cov.update({f"linear:{s}": INT8_IMPL for s in INT8_SCHEMES})
        return cov
