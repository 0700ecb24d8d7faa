"""Multi-head latent attention (DeepSeek V2/V3): the projections here; the backend's MLA op takes q and
the kv_a projection from there (latent norm, RoPE, KV-cache write, prefill / decode attention over the
paged latent cache), so a backend can fuse the small pre-attention ops into one kernel.

Tensor parallelism splits the heads: each "tp" rank runs num_attention_heads / tp of them (q_b_proj or
q_proj and kv_b_proj column-parallel by heads, o_proj row-parallel, its partial sums all-reduced once);
q_a / kv_a and the latent norm are replicated, so every rank writes and keeps the whole latent KV cache
(MLA's one latent vector serves all heads) and the backend op sees only the local head count.

Context-parallel prefill (a ContextParallelBatch, parallel/cp_batch.py): the layer computes its rank's
tokens, shares their latent entries with the other cp ranks and attends for its own query segments
(cp_attention.py)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.backend import Backend, ForwardBatch, Fp8Act, KVCaches, MLAPrologWeights, MLASpec
from deepinfer.backend.native.rope import mla_softmax_scale
from deepinfer.errors import BackendError, ModelLoadError
from deepinfer.models.deepseek_v3.config import DeepseekConfig
from deepinfer.models.layers.cp_attention import context_parallel_mla
from deepinfer.models.layers.kv_scale import KVScaleTensors
from deepinfer.models.layers.linear import Linear, Loader, MergedLinear, tp_communicator
from deepinfer.models.weights import tensor_loader
from deepinfer.parallel.cp_batch import ContextParallelBatch

MLA_GROUP = "mla"
LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default eps, not rms_norm_eps


class MLAAttention(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_id: int, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.comm = tp_communicator(backend)
        self.dtype = dtype
        tp = self.comm.world_size
        if cfg.num_attention_heads % tp:
            raise ModelLoadError(f"num_attention_heads {cfg.num_attention_heads} does not split over "
                                 f"tensor_parallel_size {tp} (the heads are spread evenly over the tp ranks)")
        self.num_heads = H = cfg.num_attention_heads // tp  # this rank's heads
        Hg = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope = cfg.qk_nope_head_dim
        self.qk_rope = cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.interleaved = cfg.rope_interleave
        D, qk = cfg.hidden_size, cfg.qk_head_dim
        quant = cfg.quantization == "fp8_block"
        bias = cfg.attention_bias
        kv_a_out = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is not None:
            # q_a_proj and kv_a_proj_with_mqa read the same input: one matmul
            self.qkv_a_proj = MergedLinear(D, [cfg.q_lora_rank, kv_a_out], backend, dtype, biases=[bias, bias],
                                           quantized=quant)
            self.q_a_layernorm: torch.Tensor | None = None
            self.q_b_proj = Linear(cfg.q_lora_rank, Hg * qk, backend, dtype, quantized=quant, split="column")
        else:
            # q_proj (no bias, as in HF) and kv_a_proj_with_mqa read the same input: one matmul
            self.q_kv_a_proj = MergedLinear(D, [Hg * qk, kv_a_out], backend, dtype, biases=[False, bias],
                                            quantized=quant, splits=["column", None])
        self.kv_a_layernorm: torch.Tensor | None = None
        self.kv_b_proj = Linear(cfg.kv_lora_rank, Hg * (cfg.qk_nope_head_dim + cfg.v_head_dim), backend, dtype,
                                quantized=quant, split="column")
        self.o_proj = Linear(Hg * cfg.v_head_dim, D, backend, dtype, bias=bias, quantized=quant, split="row")
        self.spec = MLASpec(
            num_heads=H,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            kv_lora_rank=cfg.kv_lora_rank,
            softmax_scale=mla_softmax_scale(qk, cfg.rope_scaling),
        )
        self.attn = backend.make_mla_attention(self.spec)
        self.hidden_size = D
        self.attention_bias = bias
        self.fused_prolog = False  # set in finalize when the op takes the layer from the hidden states
        self.kv_scales: KVScaleTensors | None = None  # the checkpoint's KV-cache scale tensors (optional_loaders)

    def loaders(self, prefix: str) -> dict[str, Loader]:
        dev = self.backend.device
        out: dict[str, Loader] = {}
        if self.q_lora_rank is not None:
            out.update(self.qkv_a_proj.loaders([f"{prefix}.q_a_proj", f"{prefix}.kv_a_proj_with_mqa"]))
            name = f"{prefix}.q_a_layernorm.weight"
            out[name] = tensor_loader(self, "q_a_layernorm", name, (self.q_lora_rank,), self.dtype, dev)
            out.update(self.q_b_proj.loaders(f"{prefix}.q_b_proj"))
        else:
            out.update(self.q_kv_a_proj.loaders([f"{prefix}.q_proj", f"{prefix}.kv_a_proj_with_mqa"]))
        name = f"{prefix}.kv_a_layernorm.weight"
        out[name] = tensor_loader(self, "kv_a_layernorm", name, (self.kv_lora_rank,), self.dtype, dev)
        out.update(self.kv_b_proj.loaders(f"{prefix}.kv_b_proj"))
        out.update(self.o_proj.loaders(f"{prefix}.o_proj"))
        return out

    def optional_loaders(self, prefix: str) -> dict[str, Loader]:
        """The fp8 KV cache's scale tensors a checkpoint may carry (models/layers/kv_scale.py)."""
        self.kv_scales = KVScaleTensors(prefix)
        return self.kv_scales.loaders()

    def finalize(self) -> None:
        scale = self.kv_scales.resolve() if self.kv_scales is not None else None
        if scale is not None:
            self.attn.load_kv_scale(scale)
        if self.q_lora_rank is not None:
            self.qkv_a_proj.finalize()
            self.q_b_proj.finalize()
        else:
            self.q_kv_a_proj.finalize()
        self.o_proj.finalize()
        # the op splits / absorbs kv_b_proj itself; it only needs the dense weight once
        self.attn.load_kv_b_proj(self.kv_b_proj.dense())
        self.kv_b_proj = None
        # an op that fuses the prolog (projections, norms, RoPE, cache write: Ascend's npu_mla_prolog_v3) keeps
        # the projection weights; the op then owns the layer from the hidden states and ours are dropped
        if self.q_lora_rank is not None and not self.attention_bias and \
                not self.attn.prolog_reasons(self.hidden_size, self.q_lora_rank, self.dtype):
            qkv_a = _merged_dense(self.qkv_a_proj)
            self.attn.load_prolog(MLAPrologWeights(
                q_a=qkv_a[: self.q_lora_rank], q_a_norm=self.q_a_layernorm, q_b=self.q_b_proj.dense(),
                kv_a=qkv_a[self.q_lora_rank :], kv_a_norm=self.kv_a_layernorm, eps=LORA_NORM_EPS))
            self.fused_prolog = True
            self.qkv_a_proj = self.q_b_proj = None

    def takes_fp8_act(self, num_tokens: int) -> bool:
        """Whether forward takes x as Fp8Act at this token count: x feeds only the first projection (q_kv_a or
        qkv_a), and that is an fp8 W8A8 linear above the size its GEMM quantizes on load. Not with the fused
        prolog (the op reads the hidden states)."""
        if self.fused_prolog:
            return False
        first = self.qkv_a_proj if self.q_lora_rank is not None else self.q_kv_a_proj
        return first.takes_fp8_act(num_tokens)

    def forward(
        self, x: torch.Tensor | Fp8Act, positions: torch.Tensor, rope_cache: torch.Tensor, batch: ForwardBatch,
        caches: KVCaches,
    ) -> torch.Tensor:
        split = isinstance(batch, ContextParallelBatch)
        if self.fused_prolog:
            if split:
                raise BackendError("context parallel: this backend's MLA op owns the layer from the hidden states "
                                   "(fused prolog), so other ranks' latent entries cannot be written")
            out = self.attn.forward_from_hidden(x, positions, rope_cache, self.interleaved,
                                                caches.get(MLA_GROUP, self.layer_id), batch, MLA_GROUP, self.backend)
            return self.comm.all_reduce(self.o_proj(out))
        T = x.rows if isinstance(x, Fp8Act) else x.shape[0]
        kv_a_out = self.kv_lora_rank + self.qk_rope
        if self.q_lora_rank is not None:
            q_a, kv_a = self.qkv_a_proj(x).split([self.q_lora_rank, kv_a_out], dim=-1)
            q_a = self.backend.rms_norm(q_a, self.q_a_layernorm, LORA_NORM_EPS)  # strided rows: no copy
            q = self.q_b_proj(q_a)
        else:
            q, kv_a = self.q_kv_a_proj(x).split([self.num_heads * (self.qk_nope + self.qk_rope), kv_a_out], dim=-1)
        q = q.view(T, self.num_heads, self.qk_nope + self.qk_rope)
        if split:
            out = context_parallel_mla(self, q, kv_a, LORA_NORM_EPS, positions, rope_cache, batch,
                                       caches.get(MLA_GROUP, self.layer_id), MLA_GROUP)
            return self.comm.all_reduce(self.o_proj(out))
        # kv_a norm, RoPE on q_pe / k_pe and the KV write: one fused kernel where the backend has one
        out = self.attn.forward_from_latent(
            q, kv_a, self.kv_a_layernorm, LORA_NORM_EPS, positions, rope_cache, self.interleaved,
            caches.get(MLA_GROUP, self.layer_id), batch, MLA_GROUP, self.backend,
        )
        return self.comm.all_reduce(self.o_proj(out))  # row-parallel o_proj: summed over the heads' ranks


def _merged_dense(merged: MergedLinear) -> torch.Tensor:
    """A MergedLinear's weight as one dense [sum(out_sizes), in] tensor in compute dtype."""
    if merged.fused is not None:
        return merged.fused.dense()
    return torch.cat([p.dense() for p in merged.parts], dim=0)
