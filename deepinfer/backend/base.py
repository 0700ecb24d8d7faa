"""The backend contract: what the runtime and the models may ask of a device.

A backend is a `Backend` subclass plus a frozen `BackendCaps`. Every op below has a
torch-native implementation in `deepinfer.backend.native` (the oracle of the conformance
suite); the `cpu` backend uses those, other backends override the ops they accelerate. Op
boundaries follow what vendors fuse: whole MLA attention, whole MoE (route -> experts ->
combine), linear per quant scheme, small fused ops, collectives. The device-specific seams the
runtime needs are here too: the KV cache layout, decode-graph capture, memory and streams.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Mapping

import torch

from deepinfer.backend.caps import BackendCaps
from deepinfer.backend.communicator import PROCESS_GROUP_NAMES, SINGLE_PROCESS, Communicator
from deepinfer.backend.fp8_act import Fp8Act, rms_norm_fp8_reference, silu_and_mul_fp8_reference
from deepinfer.backend.kv_caches import KVLayout
from deepinfer.backend.kv_spec import KVCacheSpec
from deepinfer.backend.layer_ops import LinearMethod, MLAAttentionOp, MoEOp, V4AttentionOp
from deepinfer.backend.op_support import OpSpec, contract_reasons
from deepinfer.backend.specs import MLASpec, MoESpec, RouterSpec, V4AttentionSpec

if TYPE_CHECKING:
    from deepinfer.backend.graph_runner import GraphRunner
    from deepinfer.backend.kv_caches import KVCaches


class Backend(ABC):
    """A device. One instance per worker, resolved once at start-up.

    Subclasses of `deepinfer.backend.native.NativeOps` get every op below in torch;
    a backend overrides what it accelerates and reports it in `op_coverage` / `op_impl`.
    """

    name: ClassVar[str]
    batch_invariance_enabled: bool = False  # set by enable_batch_invariance

    @property
    @abstractmethod
    def caps(self) -> BackendCaps: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    def enable_batch_invariance(self) -> None:
        """Switch to batch-invariant ops. The engine calls it at start-up, before the model is built, when
        EngineConfig.batch_invariant is set and `caps` allow it; from then on the ops `make_*`,
        `linear_method` and the small ops hand out give a row the same bits whatever its batch. Default:
        nothing to switch, for a backend whose ops are invariant as they stand. An override calls super()."""
        self.batch_invariance_enabled = True

    # ------------------------------------------------------------ small fused ops

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rms_norm(x + residual), x + residual)."""

    @abstractmethod
    def rotary_embedding(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, Hq, R]
        k: torch.Tensor,  # [T, Hk, R]
        cos_sin_cache: torch.Tensor,  # [max_pos, R] fp32: cos in [:R/2], sin in [R/2:]
        interleaved: bool,  # True: pairs (2i, 2i+1) rotate (DeepSeek); False: halves
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]; with `limit` (V4's swiglu_limit) the gate is clamped
        from above and the up half to [-limit, limit] first."""

    @abstractmethod
    def kv_cache_write(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        """cache.view(-1, *entry)[slot] = values[i] for slot >= 0; slot -1 is skipped."""

    @abstractmethod
    def route(
        self,
        router_logits: torch.Tensor,  # [T, E] fp32
        spec: RouterSpec,
        correction_bias: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        tid2eid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32, final, scaling applied; topk_ids [T, k] int64)."""

    @abstractmethod
    def v4_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm as DeepSeek-V4 rounds it. With a weight: the statistic and the weight product in
        fp32, one cast to x's dtype at the end. Without (the per-head q norm, the hyper-connection
        norm): the statistic in fp32, the product x * rsqrt(...) in x's dtype."""

    @abstractmethod
    def v4_rotary_embedding(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] or [T, D] with its trailing 2 * R/2 channels rotated in interleaved pairs by
        cos / sin [T, R/2] (pass -sin for the inverse rotation); computed in fp32, rounded to x's dtype."""

    def rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[Fp8Act, torch.Tensor | None]:
        """rms_norm (of x + residual when residual is given) whose output is also quantized for fp8 W8A8
        consumers (backend/fp8_act.py): (Fp8Act, x + residual or None). Its q / s equal the reference's
        quantization of the returned x, bit for bit. Default: the norm op, then the torch reference quantization;
        a backend with W8A8 GEMMs overrides it with one pass over each row."""
        return rms_norm_fp8_reference(self, x, residual, weight, eps)

    def silu_and_mul_fp8(self, x: torch.Tensor, keep_values: bool = False) -> Fp8Act:
        """silu_and_mul (no clamp) whose output is quantized for an fp8 W8A8 consumer (backend/fp8_act.py): q / s
        equal the reference's quantization of silu_and_mul(x), bit for bit; keep_values: Fp8Act.x holds those
        values too (else None). Default: the op, then the torch reference quantization."""
        return silu_and_mul_fp8_reference(self, x, keep_values)

    # ------------------------------------------------------------ sampling ops

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: torch.Tensor | None = None) -> torch.Tensor:
        """Structured output's grammar mask, in place (returns logits): logits[rows[i], t] = -inf where
        bit t % 32 of bitmask[i, t // 32] is clear, or t >= 32 * bitmask.shape[1]. logits float [N, V],
        bitmask int32 [M, W] on the device, rows int64 [M] (None: M == N). Default: the torch-native
        op (backend/native/grammar.py); a backend overrides it with one fused kernel."""
        from deepinfer.backend.native.grammar import apply_token_bitmask

        return apply_token_bitmask(logits, bitmask, rows)

    # ------------------------------------------------------------ runtime ops

    def decode_rows_meta(self, table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                         tokens_per_entry: int, block_size: int, tables_out: torch.Tensor, slots_out: torch.Tensor,
                         seq_lens_out: torch.Tensor | None = None, context_lens_out: torch.Tensor | None = None,
                         positions_out: torch.Tensor | None = None, link: torch.Tensor | None = None,
                         lens: torch.Tensor | None = None) -> None:
        """One-token decode rows' table rows, KV slots, lengths and positions from a KV group's tables, in place
        (what a captured MTP graph runs before each forward; the contract and the rule: backend/native/
        decode_rows.py). Default: the torch-native op, ~20 small kernels; a backend overrides it with one."""
        from deepinfer.backend.native.decode_rows import decode_rows_meta

        decode_rows_meta(table, rows, positions, tokens_per_entry, block_size, tables_out, slots_out,
                         seq_lens_out, context_lens_out, positions_out, link, lens)

    def draft_pick(self, logits: torch.Tensor, vocab: int, ids_out: torch.Tensor, conf_out: torch.Tensor,
                   out_ids: torch.Tensor | None = None, out_conf: torch.Tensor | None = None,
                   link: torch.Tensor | None = None) -> None:
        """Each row's draft (argmax) and confidence (its softmax probability) from the drafter's logits, in place,
        also at a chain link's column (the contract: backend/native/draft_pick.py). Default: the torch-native op,
        ~6 small kernels; a backend overrides it with one."""
        from deepinfer.backend.native.draft_pick import draft_pick

        draft_pick(logits, vocab, ids_out, conf_out, out_ids, out_conf, link)

    # ------------------------------------------------------------ layer ops

    @abstractmethod
    def linear_method(self, scheme: str) -> LinearMethod: ...

    @abstractmethod
    def make_mla_attention(self, spec: MLASpec) -> MLAAttentionOp: ...

    @abstractmethod
    def make_moe(self, spec: MoESpec) -> MoEOp: ...

    @abstractmethod
    def make_v4_attention(self, spec: V4AttentionSpec) -> V4AttentionOp: ...

    # ------------------------------------------------------------ collectives

    def communicator(self, group: str = "tp") -> Communicator:
        """The collectives models call over one of this process's groups (backend/communicator.py):
        "tp" (the tensor-parallel group: attention heads, dense layers, the vocabulary), "dp" (the
        data-parallel attention ranks that hold the same tensor-parallel rank), "ep" (the ranks the routed
        experts are spread over). One process, or a group never installed: the identity (a group of one)."""
        if group not in PROCESS_GROUP_NAMES:
            raise ValueError(f"communicator group must be one of {PROCESS_GROUP_NAMES}, got {group!r}")
        comms = self.__dict__.get("_communicators")
        return comms[group] if comms and group in comms else SINGLE_PROCESS

    def make_communicator(self, group, name: str) -> Communicator:
        """A communicator over `group`, a torch.distributed ProcessGroup of this job that holds this process
        (its transport chosen when the job's default group was initialized: gloo, NCCL, HCCL). Default: the
        torch.distributed collectives as they are (backend/dist_communicator.py)."""
        from deepinfer.backend.dist_communicator import TorchDistributedCommunicator

        return TorchDistributedCommunicator(group, name)

    def install_communicators(self, comms: "Mapping[str, Communicator]") -> None:
        """Called by the engine (deepinfer/parallel/) after torch.distributed is up and before the model is
        built: the communicators `communicator(group)` hands out from then on."""
        unknown = sorted(set(comms) - set(PROCESS_GROUP_NAMES))
        if unknown:
            raise ValueError(f"unknown communicator groups {unknown} (known: {PROCESS_GROUP_NAMES})")
        wrong = sorted(g for g, c in comms.items() if not isinstance(c, Communicator))
        if wrong:
            raise TypeError(f"communicators for groups {wrong} are not Communicator instances")
        self._communicators = dict(comms)

    # ------------------------------------------------------------ runtime seams

    def kv_cache_layout(self, spec: KVCacheSpec) -> KVLayout:
        """How this backend stores a KV group's entries (its ops read what this says); by default
        one tensor [num_blocks, block_size, *spec.entry_shape] per layer."""
        return KVLayout.single(spec)

    def make_graph_runner(self, model, caches: "KVCaches", block_size: int, max_model_len: int,
                          max_num_seqs: int) -> "GraphRunner | None":
        """Capture decode graphs for `model` over `caches`; called only when caps.graph_capture is
        true and enforce_eager is off. A backend that declares graph_capture must override it."""
        return None

    # ------------------------------------------------------------ per-op support

    def supports(self, op: OpSpec) -> list[str]:
        """Reasons this backend cannot run `op` (empty: it can). The default checks the caps; a
        backend adds what its kernels cannot take (a head dim, a router variant, ...)."""
        return contract_reasons(self, op)

    def op_impl(self, op: OpSpec) -> str:
        """What runs `op` here ("native", "triton", "cuda", ...), for coverage reports."""
        return self.op_coverage().get(op.op, "native")

    def op_coverage(self) -> dict[str, str]:
        """op name -> how this backend runs it, summarised over every spec."""
        return {}

    # ------------------------------------------------------------ device services

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device memory the KV cache may use."""
        raise NotImplementedError(f"backend {self.name!r} does not report memory")

    def synchronize(self) -> None:
        return None

    # The KV tiers' device <-> host copies (kv/tier_copies.py). The native default runs them synchronously in
    # program order, which is right where the device is host memory (cpu); a backend with a device queue runs
    # them on a side stream, so the host never waits and the compute stream waits only where it must.

    def copy_stream(self) -> object | None:
        """The stream the KV tiers' copies run on, beside the compute stream; None: copies are synchronous."""
        return None

    def host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Host memory a copy to or from the device can run asynchronously with (pinned where it matters)."""
        return torch.empty(shape, dtype=dtype)

    def copy_async(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: object | None) -> object | None:
        """Copy srcs[i] into dsts[i] on `stream` (from copy_stream()), ordered after the work queued so far on the
        compute stream, without the host waiting. Returns an event that completes with the copies (None: they
        are done already, as in this native default)."""
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)
        return None

    def wait_event(self, event: object | None) -> None:
        """Make the compute stream's later work wait for `event` (from copy_async); the host does not wait."""
        return None

    def event_done(self, event: object | None) -> bool:
        """Whether the copies behind `event` have finished (never blocks)."""
        return True

    def event_synchronize(self, event: object | None) -> None:
        """Block the calling host thread until the copies behind `event` have finished."""
        return None

