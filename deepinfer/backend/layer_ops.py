"""The contract's layer ops: the whole-layer objects a backend hands back for a spec (MLA
attention, MoE, V4 attention) and the linear-method interface, one per quant scheme.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from deepinfer.backend.specs import MLASpec, MoESpec, V4AttentionSpec
from deepinfer.errors import BackendError

if TYPE_CHECKING:
    from deepinfer.backend.base import Backend
    from deepinfer.backend.forward_batch import ForwardBatch
    from deepinfer.backend.fp8_act import Fp8Act
    from deepinfer.backend.kv_caches import KVCaches
    from deepinfer.backend.quantized_experts import QuantizedExperts


class LinearMethod(ABC):
    """Linear layers of one quant scheme.

    `layer` is a module with `weight` ([out, in], as loaded), optional
    `weight_scale_inv` (fp8 block scales, [ceil(out/128), ceil(in/128)]) and
    optional `bias`. The method converts it after loading, then applies it.
    """

    scheme: ClassVar[str]

    @abstractmethod
    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        """Convert loaded weights in place into this backend's layout."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W^T (+ bias); x [T, in] in compute dtype, y [T, out]."""

    @abstractmethod
    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """The weight as a dense [out, in] tensor in compute dtype (for ops that fold it, e.g. MLA absorb)."""

    def takes_fp8_act(self, layer: torch.nn.Module, num_tokens: int) -> bool:
        """Whether `apply_fp8_act` reads the pre-quantized activations (backend/fp8_act.py) at this token count,
        so the norm before it should write them; the default: never (apply_fp8_act then takes their x)."""
        return False

    def apply_fp8_act(self, layer: torch.nn.Module, act: Fp8Act) -> torch.Tensor:
        """`apply` on activations that came quantized (per token per 128 channels, Fp8Act); the default reads
        their compute-dtype values, a W8A8 method its e4m3 values and scales."""
        return self.apply(layer, act.values())


@dataclass(frozen=True)
class MLAPrologWeights:
    """The dense weights of an MLA layer's projections before the attention (layers with q_lora_rank and no
    attention bias: DeepSeek V2 / V3 / R1), [out, in] in compute dtype as the model loaded them (this rank's
    shard under tensor parallelism), for an op that fuses the prolog (`MLAAttentionOp.load_prolog`)."""

    q_a: torch.Tensor  # [q_lora_rank, hidden] (q_a_proj)
    q_a_norm: torch.Tensor  # [q_lora_rank] (q_a_layernorm)
    q_b: torch.Tensor  # [H * (qk_nope + qk_rope), q_lora_rank] (q_b_proj: per head nope rows, then rope rows)
    kv_a: torch.Tensor  # [kv_lora_rank + qk_rope, hidden] (kv_a_proj_with_mqa)
    kv_a_norm: torch.Tensor  # [kv_lora_rank] (kv_a_layernorm)
    eps: float  # of both lora norms


class MLAAttentionOp(ABC):
    """One MLA attention layer from projected q / latent kv to the per-head output.

    Owns the KV-cache write, prefill (naive MHA over the up-projected latent
    context, causal, on top of any cached prefix) and decode (absorbed, over the
    paged latent cache). The model does the projections and calls
    `forward_from_latent`, whose default runs the latent norm and RoPE through
    the backend's small ops and then `forward`; a backend may fuse them.
    """

    def __init__(self, spec: MLASpec):
        self.spec = spec
        # the fp8 cache's per-layer scale (stored = x / kv_scale): 1.0 unless a checkpoint gives one
        self.kv_scale: float = 1.0

    def load_kv_scale(self, scale: float) -> None:
        """The layer's fp8 KV-cache scale (a checkpoint's `self_attn.k_scale`, models/layers/kv_scale.py), kept as
        the fp32 value it is used as. Every op keeps it; only an op whose backend lists an fp8 cache
        (BackendCaps.kv_cache_dtypes) reads it, and the engine refuses an fp8 cache elsewhere."""
        s = float(torch.tensor(float(scale), dtype=torch.float32))  # checked as used: fp32 may round it to 0 or inf
        if not (s > 0 and s != float("inf")):
            raise BackendError(f"MLA fp8 KV scale must be a positive finite number (in fp32), got {scale!r}")
        self.kv_scale = s

    @abstractmethod
    def load_kv_b_proj(self, weight: torch.Tensor) -> None:
        """kv_b_proj as dense [H * (qk_nope + v), kv_lora_rank]; split / absorb it here."""

    def split_kv_b_proj(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Check kv_b_proj's shape; (W_UK [H, qk_nope, L], W_UV [H, v, L]) as views of `weight`."""
        s = self.spec
        expect = (s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)
        if tuple(weight.shape) != expect:
            raise BackendError(f"kv_b_proj weight has shape {tuple(weight.shape)}, expected {expect}")
        w = weight.detach().view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return w[:, : s.qk_nope_head_dim], w[:, s.qk_nope_head_dim :]

    def check_inputs(self, q: torch.Tensor, kv_cache, loaded: bool) -> None:
        """Shape checks every implementation shares; raises BackendError naming the mismatch.
        kv_cache: one tensor, or a tuple of parts (a split layout) whose widths add up to the entry."""
        s = self.spec
        if not loaded:
            raise BackendError("MLA forward before load_kv_b_proj")
        if tuple(q.shape[1:]) != (s.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim):
            raise BackendError(f"MLA q has shape {tuple(q.shape)}, expected [T, {s.num_heads}, "
                               f"{s.qk_nope_head_dim + s.qk_rope_head_dim}]")
        width = sum(p.shape[-1] for p in kv_cache) if isinstance(kv_cache, (tuple, list)) else kv_cache.shape[-1]
        if width != s.cache_entry_dim:
            raise BackendError(f"MLA cache entries are {width} wide, expected {s.cache_entry_dim}")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, qk_nope + qk_rope], RoPE applied
        kv_c: torch.Tensor,  # [T, kv_lora_rank], normed
        k_pe: torch.Tensor,  # [T, qk_rope], RoPE applied
        kv_cache,  # the layer's cache in the backend's layout (default: [num_blocks, block_size, L + R])
        batch: ForwardBatch,
        group: str,  # this layer's KV group: its key in batch.block_tables / slot_mapping
    ) -> torch.Tensor:  # [T, H * v_head_dim]
        ...

    def forward_from_latent(
        self,
        q: torch.Tensor,  # [T, H, qk_nope + qk_rope], RoPE NOT applied; an override may rotate it in place
        kv_a: torch.Tensor,  # [T, kv_lora_rank + qk_rope]: kv_a_proj_with_mqa output, before norm / RoPE
        kv_norm_weight: torch.Tensor,  # [kv_lora_rank] (kv_a_layernorm)
        eps: float,
        positions: torch.Tensor,  # [T] int64
        rope_cache: torch.Tensor,  # [max_pos, qk_rope] fp32: cos in [:R/2], sin in [R/2:]
        interleaved: bool,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        group: str,
        ops: Backend,  # whose rms_norm / rotary_embedding this default composes
    ) -> torch.Tensor:  # [T, H * v_head_dim]
        """The layer from the projections: kv_a RMSNorm, RoPE on q_pe / k_pe, then `forward`.

        This default composes the backend's small ops as the model always did. A backend
        overrides it to fuse norm + RoPE + KV write into one kernel, keeping these rounding
        points (norm and RoPE in fp32, each rounded to the input dtype).
        """
        s = self.spec
        t = q.shape[0]
        kv_c, k_pe = kv_a.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        kv_c = ops.rms_norm(kv_c.contiguous(), kv_norm_weight, eps)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = ops.rotary_embedding(
            positions, q_pe.contiguous(), k_pe.contiguous().view(t, 1, s.qk_rope_head_dim), rope_cache, interleaved
        )
        q = torch.cat([q_nope, q_pe], dim=-1)
        return self.forward(q, kv_c, k_pe.reshape(t, s.qk_rope_head_dim), kv_cache, batch, group)

    # ------------------------------------------------------------ optional: the prolog from the hidden states

    prolog: MLAPrologWeights | None = None  # set by an override of load_prolog that keeps the weights

    def prolog_reasons(self, hidden_size: int, q_lora_rank: int, dtype: torch.dtype) -> list[str]:
        """Why this op cannot take the layer from the hidden states (empty: it can, and load_prolog keeps the
        weights). The model asks before it builds MLAPrologWeights; this default fuses no prolog."""
        return [f"{type(self).__name__} does not fuse the MLA prolog"]

    def load_prolog(self, weights: MLAPrologWeights) -> None:
        """Keep the projection weights (only called when prolog_reasons is empty). The model then drops its own
        projections and calls forward_from_hidden for every batch."""
        raise BackendError(f"{type(self).__name__} does not fuse the MLA prolog (prolog_reasons says why)")

    def forward_from_hidden(
        self,
        x: torch.Tensor,  # [T, hidden]: the attention input (after the input layernorm)
        positions: torch.Tensor,  # [T] int64
        rope_cache: torch.Tensor,  # [max_pos, qk_rope] fp32: cos in [:R/2], sin in [R/2:]
        interleaved: bool,
        kv_cache,
        batch: ForwardBatch,
        group: str,
        ops: Backend,
    ) -> torch.Tensor:  # [T, H * v_head_dim]
        """The layer from the hidden states, for an op that kept the prolog weights. This default is the model's
        own composition (q_a / kv_a projections, q_a RMSNorm, q_b projection, then forward_from_latent); an op
        runs a fused prolog for the batches it takes and this for the others."""
        w = self.prolog
        if w is None:
            raise BackendError("forward_from_hidden before load_prolog")
        s = self.spec
        q_a = ops.rms_norm(torch.nn.functional.linear(x, w.q_a), w.q_a_norm, w.eps)
        q = torch.nn.functional.linear(q_a, w.q_b).view(x.shape[0], s.num_heads, -1)
        kv_a = torch.nn.functional.linear(x, w.kv_a)
        return self.forward_from_latent(q, kv_a, w.kv_a_norm, w.eps, positions, rope_cache, interleaved, kv_cache,
                                        batch, group, ops)


class MoEOp(ABC):
    """Routed experts: route -> dispatch -> experts (SwiGLU) -> weighted combine.

    Two entries. `forward` / `forward_hidden` run the whole layer on this rank (routing included): the
    path without expert parallelism. Under expert parallelism the model splits it: `route` picks the
    (weights, ids) over ALL logical experts of `spec.router`, the model maps each (token, slot) pair to a
    physical slot on this rank (an id in [0, spec.local_experts)) or to -1 (a replica another rank holds),
    and `experts` computes only this rank's pairs; the model then all-reduces the partial sums over "ep".
    An op that cannot skip -1 ids says why in `expert_parallel_reasons` (the model refuses to start).
    """

    def __init__(self, spec: MoESpec):
        self.spec = spec

    @abstractmethod
    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """w13 [E_local, 2*I, D] (gate rows then up rows), w2 [E_local, D, I], dense in compute dtype;
        E_local = spec.local_experts (this rank's physical slots under expert parallelism)."""

    def quantized_expert_schemes(self) -> tuple[str, ...]:
        """The QuantizedExperts schemes `load_quantized_experts` takes (this default: none, so the model
        densifies quantized experts through the linear method and calls load_experts, as every op supports)."""
        return ()

    def load_quantized_experts(self, experts: QuantizedExperts) -> None:
        """Keep the experts quantized (only called with a scheme from quantized_expert_schemes, and with a
        w13_g_idx only where it lists INT4_ACT_ORDER); forward / experts then compute with them. Replaces any dense
        experts loaded before."""
        raise BackendError(f"{type(self).__name__} does not run quantized routed experts "
                           f"({experts.scheme}); quantized_expert_schemes() lists what it takes")

    def replace_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """New weights for the same slots, between steps (the expert load balancer moved experts). Shapes as
        load_experts. The default loads them again; an op whose loaded tensors a captured graph reads copies
        in place instead."""
        self.load_experts(w13, w2)

    def check_expert_shapes(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Raise BackendError unless w13 / w2 have the shapes load_experts documents."""
        e, d, i = self.spec.local_experts, self.spec.hidden_size, self.spec.intermediate_size
        if tuple(w13.shape) != (e, 2 * i, d):
            raise BackendError(f"MoE w13 has shape {tuple(w13.shape)}, expected {(e, 2 * i, d)}")
        if tuple(w2.shape) != (e, d, i):
            raise BackendError(f"MoE w2 has shape {tuple(w2.shape)}, expected {(e, d, i)}")

    def expert_parallel_reasons(self) -> list[str]:
        """Why `route` + `experts` with -1 ids cannot run on this op (empty: they can)."""
        return [f"{type(self).__name__} does not implement route() / experts() with -1 ids (expert parallelism)"]

    def route(
        self,
        router_logits: torch.Tensor,  # [T, E] fp32, E = spec.router.num_experts (every logical expert)
        correction_bias: torch.Tensor | None = None,  # [E], selection only
        token_ids: torch.Tensor | None = None,  # [T], hash routing
        tid2eid: torch.Tensor | None = None,  # [vocab, top_k], hash routing
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32 with routed_scaling_factor applied, topk_ids [T, k] int64 logical ids), as
        `forward` routes."""
        raise BackendError(f"{type(self).__name__} does not expose route()")

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """sum over slots j of topk_weights[t, j] * expert_{ids[t, j]}(x_t), [T, D] in x's dtype, for already-
        chosen pairs; ids index the loaded experts ([0, spec.local_experts)) and a -1 id contributes nothing
        (its weight is ignored). T = 0 gives [0, D]."""
        raise BackendError(f"{type(self).__name__} does not expose experts()")

    def router_logits(self, x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
        """fp32 router logits [T, E] = x [T, D] (activation dtype) @ gate_weight [E, D] (fp32)^T, in fp32 as
        the reference gate; an op may skip the fp32 copy of x (the default makes it)."""
        return torch.nn.functional.linear(x.float(), gate_weight.float())

    def forward_hidden(
        self,
        x: torch.Tensor,  # [T, D]
        gate_weight: torch.Tensor,  # [E, D] fp32 router gate
        correction_bias: torch.Tensor | None = None,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """forward() from the hidden states, so an op may fuse the router GEMV with the top-k; the
        default computes router_logits, then forward."""
        return self.forward(x, self.router_logits(x, gate_weight), correction_bias, shared_experts=shared_experts)

    def takes_fp8_act(self, num_tokens: int) -> bool:
        """Whether `forward_hidden` takes its x as Fp8Act (backend/fp8_act.py: quantized by the norm before it, for
        W8A8 experts) at this token count; the default: never, and forward_hidden is then never given one."""
        return False

    def fuse_shared_experts(self, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        """Offer the dense weights of the shared-experts MLP that `forward`'s `shared_experts` computes:
        gate_up [2*S*I, D] (S*I gate rows, then S*I up rows), down [D, S*I], S = n_shared_experts.

        An op may then run that MLP as S more experts of width I (weight 1.0) inside its routed
        GEMMs at small batches (sum of their outputs == the MLP). Returns whether it kept them;
        the default keeps nothing and calls `shared_experts` instead.
        """
        return False

    def fuse_shared_quantized(self, shared: QuantizedExperts) -> bool:
        """Offer the shared experts as S more experts in the routed experts' quantized scheme and layout
        (shared.scheme == the kept experts' scheme; built by models/layers/quant/shared_experts.py), when the
        routed experts were kept quantized (`load_quantized_experts`). As `fuse_shared_experts`: the op may
        run them (weight 1.0) inside its routed GEMMs at small batches; returns whether it kept them."""
        return False

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,  # [T, D]
        router_logits: torch.Tensor,  # [T, E] fp32
        correction_bias: torch.Tensor | None = None,  # [E], used for selection only
        token_ids: torch.Tensor | None = None,  # [T], for hash routing
        tid2eid: torch.Tensor | None = None,  # [vocab, top_k], for hash routing
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,  # x -> [T, D], added (weight 1.0)
    ) -> torch.Tensor:  # [T, D]: routed experts (scaled by routed_scaling_factor) + shared_experts(x) if given
        ...


class V4AttentionOp(ABC):
    """One DeepSeek-V4 attention layer from projected, RoPE'd q / kv to the per-head output.

    Owns the cache layout and writes (sliding-window keys, compressed entries,
    indexer keys, per-sequence compressor state), the compressors, the indexer
    top-k and the attention with per-head sinks. The model does the projections,
    norms, RoPE on q / kv, the inverse RoPE on the output and the output projection.
    """

    def __init__(self, spec: V4AttentionSpec):
        self.spec = spec

    @abstractmethod
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """fp32 tensors: "sinks" [H]; with a compressor also "rope_inv_freq" [R/2],
        "compressor.position_bias" [m, C*D], "compressor.norm_weight" [D]; CSA also
        "indexer.position_bias" [m, 2*Di], "indexer.norm_weight" [Di]."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D], RoPE applied
        kv: torch.Tensor,  # [T, D], normed, RoPE applied (shared key and value)
        caches: KVCaches,
        layer_id: int,
        batch: ForwardBatch,
        comp_kv: torch.Tensor | None = None,  # [T, C*D] compressor kv projection (C = 2 for CSA)
        comp_gate: torch.Tensor | None = None,  # [T, C*D]
        index_q: torch.Tensor | None = None,  # [T, Hi, Di], RoPE applied
        index_weights: torch.Tensor | None = None,  # [T, Hi], scaled by Hi^-0.5
        index_kv: torch.Tensor | None = None,  # [T, 2*Di]
        index_gate: torch.Tensor | None = None,  # [T, 2*Di]
    ) -> torch.Tensor:  # [T, H, D], before the inverse RoPE
        ...
