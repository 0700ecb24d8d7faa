"""The op specs: the frozen shapes and variants a model hands the backend when it asks for a layer op.

A spec says everything a backend needs to choose (or refuse) an implementation: `Backend.supports`
takes an `OpSpec` naming the op, its spec and dtype, and answers with reasons.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLASpec:
    """Shapes of one MLA attention layer (DeepSeek V2/V3)."""

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    softmax_scale: float

    @property
    def cache_entry_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class RouterSpec:
    """How a MoE layer picks experts.

    scoring_func: "softmax" | "sigmoid" | "sqrtsoftplus" (V4).
    topk_method: "greedy" | "group_limited_greedy" | "noaux_tc" | "hash" (V4, tid2eid).
    """

    num_experts: int
    top_k: int
    scoring_func: str
    topk_method: str
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class MoESpec:
    """A routed-experts layer; shared experts are a dense MLP in the model."""

    router: RouterSpec
    hidden_size: int
    intermediate_size: int  # per expert (this rank's part of it when the experts are split over "tp")
    swiglu_limit: float | None = None  # V4 clamps gate/up activations when set
    # experts loaded on this rank (expert parallelism: this rank's physical slots, redundant replicas included);
    # None = every logical expert of the router, in router order (no expert parallelism)
    num_local_experts: int | None = None

    @property
    def local_experts(self) -> int:
        """How many experts `load_experts` takes: the ids `experts` accepts are [0, this) and -1."""
        return self.router.num_experts if self.num_local_experts is None else self.num_local_experts


@dataclass(frozen=True)
class V4AttentionSpec:
    """One DeepSeek-V4 attention layer: shared-KV MQA over a sliding window plus, on CSA / HCA
    layers, compressed entries (CSA picks them with the lightning indexer).

    KV groups (KVCacheSpec names): `swa_group` holds one key per token (sliding window),
    `comp_group` one compressed entry per `compress_rate` tokens (+ the compressor's
    per-sequence state), `index_group` the indexer's entries (+ its state), CSA only.
    """

    num_heads: int  # this rank's heads (tensor parallelism splits them; the one shared KV head is whole)
    head_dim: int
    sliding_window: int
    softmax_scale: float
    swa_group: str
    compress_rate: int = 0  # 0: sliding window only
    overlap: bool = False  # CSA: overlapping windows (two series) + lightning indexer
    comp_group: str | None = None
    index_group: str | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    norm_eps: float = 1e-6
    rope_attention_factor: float = 1.0  # cos/sin magnitude of the compressed entries' RoPE
