"""`NvidiaBackend`: NativeOps with the hot path overridden by Triton and CUDA C++ kernels.

Built on a CUDA device normally. With TRITON_INTERPRET=1 it can also be built
on the CPU (`NvidiaBackend(device="cpu")`), so CI runs the same Triton
kernels through the interpreter at tiny shapes.
"""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.backend import (
    Backend,
    BackendCaps,
    Communicator,
    MLAAttentionOp,
    MLASpec,
    MoEOp,
    MoESpec,
    NativeOps,
    OpSpec,
    RouterSpec,
    TorchDistributedCommunicator,
    host_memory_info,
    validate_router,
)
from deepinfer.errors import BackendError

KV_BLOCK_SIZES = (64, 16, 32, 128)
QUANT_KERNEL_SCHEMES = ("fp8_w8a8", "int4_awq", "int4_gptq")  # linear schemes run by quant/'s Triton kernels
# the norm / SiLU-and-mul writing their output's fp8 quantization (backend/fp8_act.py): one Triton pass each
FP8_ACT_OPS = {"rms_norm_fp8": "triton (quant/rmsnorm_fp8.py: the norm and the e4m3 quant in one pass)",
               "silu_and_mul_fp8": "triton (quant/fp8_act_quant.py: SiLU-and-mul and the e4m3 quant in one pass)"}


def _interpreting() -> bool:
    return envs.TRITON_INTERPRET.get() == "1"


class NvidiaBackend(NativeOps, Backend):
    """Triton kernels for norm / RoPE / KV write / SiLU / routing / MoE / MLA; cuBLAS linears.

    `use_cuda_ext`: run the CUDA C++ routing / alignment kernels from csrc/cuda
    (compiled on first use); None picks them when a CUDA compiler is present
    and the device is a GPU.
    """

    name = "nvidia"

    def __init__(self, device: str | torch.device | None = None, use_cuda_ext: bool | None = None) -> None:
        dev = torch.device(device if device is not None else ("cpu" if _interpreting() and not
                                                              torch.cuda.is_available() else "cuda"))
        if dev.type == "cpu":
            if not _interpreting():
                raise BackendError("NvidiaBackend on the CPU needs TRITON_INTERPRET=1 (the Triton interpreter)")
            self._device = dev
            cc = (0, 0)
        elif dev.type == "cuda":
            if not torch.cuda.is_available():
                raise BackendError("NvidiaBackend: torch sees no CUDA device")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            self._device = torch.device("cuda", index)
            cc = torch.cuda.get_device_capability(index)
            if cc < (8, 0):
                raise BackendError(f"NvidiaBackend needs compute capability >= 8.0, found {cc[0]}.{cc[1]}")
        else:
            raise BackendError(f"NvidiaBackend cannot run on device {str(dev)!r}")
        on_gpu = self._device.type == "cuda"
        self._caps = BackendCaps(
            device_type="cuda" if on_gpu else "cpu",
            dtypes=(torch.bfloat16, torch.float16, torch.float32),
            kv_block_sizes=KV_BLOCK_SIZES,
            # fp8_w8a8 / int4_*: Triton kernels on quantized weights (quant/); fp8_block: dequantized at load
            quant_schemes=("none", "fp8_block", "fp8_w8a8", "int4_awq", "int4_gptq"),
            # fused_moe_gemm: W8A16 / W4A16 dequantized in the inner loop; fp8_w8a8 on the fp8 tensor cores
            moe_quant_schemes=("fp8_block", "fp8_w8a8", "fp4", "int4_awq", "int4_gptq"),
            model_types=("deepseek_v2", "deepseek_v3"),
            batch_invariant=True,  # with enable_batch_invariance: the kernels of invariant/
            batch_invariant_model_types=("deepseek_v2", "deepseek_v3"),
            graph_capture=on_gpu,
            graph_decode_rows=True,  # mla_prep writes every row's latent before the decode kernel reads any
            max_tensor_parallel_size=1,
            kv_cache_dtypes=("auto", "fp8_e4m3"),  # fp8: the MLA latent cache (mla_prep / kv_write / mla_decode)
            fused_act_quant=True,  # quant/rmsnorm_fp8.py, fp8_act_quant.silu_mul_fp8_act (backend/fp8_act.py)
        )
        self._cuda_ext = None
        self._copy_stream = None  # the KV tiers' copy stream, made on first use (copy_stream)
        if use_cuda_ext is None:
            # Default on where a CUDA compiler exists: measured faster than the Triton / torch twins
            # (docs/perf-log/2026-11-29-first-h200-baseline.md). DEEPINFER_NVIDIA_CUDA_EXT=0 / =1 forces it; op_coverage says which runs.
            from deepinfer.backends.nvidia import cuda_ext

            flag = envs.NVIDIA_CUDA_EXT.get()  # None: auto
            use_cuda_ext = on_gpu and (flag is True or (flag is None and cuda_ext.compiler_available()))
        if use_cuda_ext:
            from deepinfer.backends.nvidia import cuda_ext

            self._cuda_ext = cuda_ext.load()  # raises BackendError naming the missing compiler

    @property
    def caps(self) -> BackendCaps:
        return self._caps

    # enable_batch_invariance: the base class sets the flag; from then on linear_method, make_mla_attention
    # and make_moe hand out invariant/'s fixed-configuration kernels (docs/determinism.md). RMSNorm, RoPE,
    # SiLU-and-mul and the KV write are row-invariant as they stand; the invariant MoE never takes the fused
    # router (CUDA C++ or GEMV + top-k).

    def linear_method(self, scheme: str):
        if not self.batch_invariance_enabled and scheme in QUANT_KERNEL_SCHEMES:
            from deepinfer.backends.nvidia.quant.linear_methods import TritonFp8W8A8Linear, TritonInt4Linear

            return TritonFp8W8A8Linear() if scheme == "fp8_w8a8" else TritonInt4Linear(scheme.removeprefix("int4_"))
        method = super().linear_method(scheme)
        if self.batch_invariance_enabled:
            from deepinfer.backends.nvidia.invariant.linear import InvariantLinear

            return InvariantLinear(method)
        return method

    @property
    def device(self) -> torch.device:
        return self._device

    def memory_info(self) -> tuple[int, int]:
        if self._device.type != "cuda":  # interpreter mode: host memory
            return host_memory_info()
        return torch.cuda.mem_get_info(self._device)

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def make_communicator(self, group, name: str) -> Communicator:
        """NCCL over `group` on the GPU (tensors stay on the device); gloo in interpreter mode on the CPU.
        Never run on several GPUs yet: caps keep max_tensor_parallel_size=1 until it has (docs/parallelism.md)."""
        return TorchDistributedCommunicator(group, name, expect_transport="nccl" if self._device.type == "cuda"
                                            else "gloo")

    # ------------------------------------------------------------ KV tier copies (a side stream, pinned memory)

    def copy_stream(self):
        """One CUDA stream for the KV tiers' copies (made on first use); None under the interpreter (host memory)."""
        if self._device.type != "cuda":
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self._device)
        return self._copy_stream

    def host_buffer(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=self._device.type == "cuda")

    def copy_async(self, dsts, srcs, stream):
        if stream is None:
            return super().copy_async(dsts, srcs, stream)
        # after what the compute stream has queued (a block handed out may still be written by the step in flight)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            for dst, src in zip(dsts, srcs):
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def wait_event(self, event):
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def event_done(self, event):
        return event is None or event.query()

    def event_synchronize(self, event):
        if event is not None:
            event.synchronize()

    # ------------------------------------------------------------ small fused ops

    def rms_norm(self, x, weight, eps):
        from deepinfer.backends.nvidia.rmsnorm import rms_norm

        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        from deepinfer.backends.nvidia.rmsnorm import add_rms_norm

        return add_rms_norm(x, residual, weight, eps)

    def rms_norm_fp8(self, x, residual, weight, eps):
        from deepinfer.backends.nvidia.quant.rmsnorm_fp8 import rms_norm_fp8

        return rms_norm_fp8(x, residual, weight, eps)

    def silu_and_mul_fp8(self, x, keep_values=False):
        from deepinfer.backends.nvidia.quant.fp8_act_quant import silu_mul_fp8_act

        return silu_mul_fp8_act(x, keep_values)

    def rotary_embedding(self, positions, q, k, cos_sin_cache, interleaved):
        from deepinfer.backends.nvidia.rope import rotary_embedding

        return rotary_embedding(positions, q, k, cos_sin_cache, interleaved)

    def silu_and_mul(self, x, limit=None):
        if limit is not None:  # V4's clamped SwiGLU: no Triton kernel yet (op_coverage says so)
            return super().silu_and_mul(x, limit)
        from deepinfer.backends.nvidia.activation import silu_and_mul

        return silu_and_mul(x)

    def apply_token_bitmask(self, logits, bitmask, rows=None):
        from deepinfer.backends.nvidia.grammar_bitmask import apply_token_bitmask

        return apply_token_bitmask(logits, bitmask, rows)

    def decode_rows_meta(self, table, rows, positions, tokens_per_entry, block_size, tables_out, slots_out,
                         seq_lens_out=None, context_lens_out=None, positions_out=None, link=None, lens=None):
        from deepinfer.backends.nvidia.decode_rows_meta import decode_rows_meta

        decode_rows_meta(table, rows, positions, tokens_per_entry, block_size, tables_out, slots_out, seq_lens_out,
                         context_lens_out, positions_out, link, lens)

    def draft_pick(self, logits, vocab, ids_out, conf_out, out_ids=None, out_conf=None, link=None):
        from deepinfer.backends.nvidia.draft_pick import draft_pick

        draft_pick(logits, vocab, ids_out, conf_out, out_ids, out_conf, link)

    def kv_cache_write(self, cache, slot_mapping, values):
        from deepinfer.backends.nvidia.kv_write import kv_cache_write

        kv_cache_write(cache, slot_mapping, values)

    def route(self, router_logits: torch.Tensor, spec: RouterSpec, correction_bias=None, token_ids=None,
              tid2eid=None):
        from deepinfer.backends.nvidia.moe import TRITON_SCORING, TRITON_TOPK

        if spec.scoring_func not in TRITON_SCORING or spec.topk_method not in TRITON_TOPK:
            return super().route(router_logits, spec, correction_bias, token_ids, tid2eid)  # V4: native
        validate_router(spec)
        if self._cuda_ext is not None:
            from deepinfer.backends.nvidia import cuda_ext

            return cuda_ext.grouped_topk(self._cuda_ext, router_logits, spec, correction_bias)
        from deepinfer.backends.nvidia.moe_routing import route

        return route(router_logits, spec, correction_bias)

    # ------------------------------------------------------------ graphs

    def make_graph_runner(self, model, caches, block_size, max_model_len, max_num_seqs):
        from deepinfer.backends.nvidia.graph_runner import CUDAGraphRunner

        return CUDAGraphRunner.capture(model, caches, block_size, max_model_len, max_num_seqs, self._device)

    # ------------------------------------------------------------ layer ops

    def make_mla_attention(self, spec: MLASpec) -> MLAAttentionOp:
        if self.batch_invariance_enabled:
            from deepinfer.backends.nvidia.invariant.mla import InvariantMLAAttention

            return InvariantMLAAttention(spec)
        from deepinfer.backends.nvidia.mla_attention import TritonMLAAttention

        return TritonMLAAttention(spec)

    def make_moe(self, spec: MoESpec) -> MoEOp:
        from deepinfer.backends.nvidia.moe import TritonMoE, triton_moe_unsupported

        if triton_moe_unsupported(spec):  # V4 routers / clamped SwiGLU: reported in op_coverage
            if self.batch_invariance_enabled:
                raise BackendError("batch-invariant MoE: no invariant kernel for " + ", ".join(triton_moe_unsupported(spec)))
            return super().make_moe(spec)
        if self.batch_invariance_enabled:
            from deepinfer.backends.nvidia.invariant.moe import InvariantMoE

            return InvariantMoE(spec)
        align = None
        if self._cuda_ext is not None:
            from deepinfer.backends.nvidia import cuda_ext

            align = cuda_ext.make_align(self._cuda_ext)
        return TritonMoE(spec, route_fn=self.route, **({"align_fn": align} if align else {}))

    # ------------------------------------------------------------ per-op support

    def supports(self, op: OpSpec) -> list[str]:
        """The caps, plus what the Triton kernels cannot take (everything else runs, natively if need be)."""
        reasons = super().supports(op)
        if op.op == "mla_attention" and isinstance(op.spec, MLASpec):
            rank = op.spec.kv_lora_rank
            if rank < 16 or rank & (rank - 1):
                reasons.append(f"kv_lora_rank {rank} is not a power of two >= 16 (the Triton MLA decode kernel)")
        return reasons

    def op_impl(self, op: OpSpec) -> str:
        """What runs `op`; the same on a GPU and under the interpreter (the CUDA C++ router needs nvcc)."""
        from deepinfer.backends.nvidia.moe import TRITON_SCORING, TRITON_TOPK, triton_moe_unsupported

        name, spec = op.op, op.spec
        if name in ("rms_norm", "add_rms_norm", "rotary_embedding", "kv_cache_write", "mla_attention"):
            return "triton"
        if name in FP8_ACT_OPS:
            return FP8_ACT_OPS[name]
        if name == "apply_token_bitmask":
            return "triton (grammar_bitmask.py: one pass, in place)"
        if name == "decode_rows_meta":
            return "triton (decode_rows_meta.py: one program per row)"
        if name == "draft_pick":
            return "triton (draft_pick.py: one program per row)"
        if name == "silu_and_mul":
            return "native (no Triton kernel for the clamped SwiGLU)" if op.option("limit") is not None else "triton"
        if name == "route" and isinstance(spec, RouterSpec):
            if spec.scoring_func in TRITON_SCORING and spec.topk_method in TRITON_TOPK:
                return "cuda (csrc/cuda) where nvcc builds it, else triton"
            return f"native ({spec.scoring_func} / {spec.topk_method}: no fused kernel)"
        if name == "moe" and isinstance(spec, MoESpec):
            why = triton_moe_unsupported(spec)
            return "triton grouped GEMM" if not why else f"native ({', '.join(why)}: no fused kernel)"
        if name == "linear:fp8_block":
            return "native (dequantized to the compute dtype at load, cuBLAS)"
        if name == "linear:fp8_w8a8":
            return "triton fp8 W8A8 block GEMM (per-token-128 activation quant kernel)"
        if name in ("linear:int4_awq", "linear:int4_gptq"):
            return ("triton int4 weight-only GEMM (dequantized in the inner loop); 1-4 tokens at group 128: the cuda "
                    "GEMV (csrc/cuda/int4_gemv.cu) where nvcc builds it")
        if name.startswith("linear:"):
            return "native (cuBLAS)"
        return "native"

    def op_coverage(self) -> dict[str, str]:
        cov = super().op_coverage()
        if self.batch_invariance_enabled:
            return self._invariant_coverage(cov)
        for op in ("rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul", "kv_cache_write",
                   "mla_attention"):
            cov[op] = "triton"
        ext = self._cuda_ext is not None
        cov["route"] = ("cuda" if ext else "triton") + \
            "; native for sqrtsoftplus/hash (V4)"
        cov["moe"] = ("triton grouped GEMM + cuda align" if ext else "triton grouped GEMM") + \
            " (<= 64 pairs: direct, shared experts folded; router GEMV + top-k <= 16 tokens)" + \
            "; native for swiglu_limit/V4 routers"
        for k in list(cov):
            if k.startswith("linear:"):
                cov[k] = "native (cuBLAS on GPU)"
        cov["linear:fp8_w8a8"] = "triton fp8 W8A8 block GEMM"
        int4_cuda = ext and envs.INT4_CUDA_GEMV.get() is not False
        cov["linear:int4_awq"] = cov["linear:int4_gptq"] = "triton int4 weight-only GEMM" + \
            ("; cuda GEMV at 1-4 tokens, group 128 (and one token's int4 experts)" if int4_cuda else "")
        cov["apply_token_bitmask"] = "triton (grammar_bitmask.py: one pass, in place)"
        cov["decode_rows_meta"] = "triton (decode_rows_meta.py: one program per row)"
        cov["draft_pick"] = "triton (draft_pick.py: one program per row)"
        cov.update(FP8_ACT_OPS)
        return cov

    def _invariant_coverage(self, cov: dict[str, str]) -> dict[str, str]:
        for op in ("rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul", "kv_cache_write"):
            cov[op] = "triton (row-invariant as it stands)"
        cov["mla_attention"] = "triton: batch-invariant (absorbed, fixed split size, invariant GEMMs)"
        cov["route"] = "triton (one program per token)"
        cov["apply_token_bitmask"] = "triton (row-invariant as it stands)"
        cov["decode_rows_meta"] = "triton (integers: row-invariant as it stands)"
        cov["draft_pick"] = "triton (row-invariant as it stands)"
        cov.update({op: impl.replace("triton (", "triton, row-invariant as it stands (") for op, impl in
                    FP8_ACT_OPS.items()})
        cov["moe"] = "triton: batch-invariant (aligned grouped GEMM, one K split; the tile follows T where checked)"
        for k in list(cov):
            if k.startswith("linear:"):
                cov[k] = "triton: batch-invariant GEMM (one K split per weight; the tile follows M where checked)"
        return cov
