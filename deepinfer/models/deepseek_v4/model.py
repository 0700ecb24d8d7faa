"""DeepSeek-V4 causal LM (V4-Flash, V4-Pro, V4.1-Flash) over the hybrid paged KV cache.

embed -> hc_mult residual streams -> per layer: [mHC collapse -> RMSNorm ->
attention -> mHC merge] then [mHC collapse -> RMSNorm -> MoE -> mHC merge]
-> HyperHead collapse -> RMSNorm -> head. Checkpoint names are DeepSeek's
release names (`embed.weight`, `layers.N.attn.wq_a.weight`, `mtp.0.*`, ...);
a leading `model.` and transformers' names for the top-level tensors are
accepted too. MTP tensors are kept aside in `mtp_weights` (one rank only: see load_weights).

Many ranks (docs/parallelism.md): attention heads split over "tp" (attention.py, parallel.py), routed
experts split over "tp" or spread over "ep" (moe.py), the vocabulary split (embedding / head); the
hyper-connections, norms and the router gates act on the whole hidden state and are replicated. Each
loader names the part of its tensor this rank reads; `load_weights` takes the checkpoint's unread handles
and reads just those parts (models/loader.deliver). Context-parallel prefill: a split step (a
ContextParallelBatch) runs this rank's tokens; its attention layers share their KV inputs (cp_attention.py).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from deepinfer.backend import Backend, KVCacheSpec
from deepinfer.backend.native.v4_compressor import ring_len
from deepinfer.errors import ModelLoadError
from deepinfer.models.base import CausalLM
from deepinfer.models.deepseek_v4.attention import COMP_GROUPS, INDEX_GROUP, SWA_GROUP, V4Attention
from deepinfer.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config, parse_v4_config
from deepinfer.models.deepseek_v4.cp_attention import context_parallel_reasons, v4_split_step
from deepinfer.models.deepseek_v4.hyper_connections import HyperConnection, HyperHead, hc_merge
from deepinfer.models.deepseek_v4.moe import V4MoE
from deepinfer.models.layers.embedding import LMHead, VocabEmbedding
from deepinfer.models.layers.linear import Loader
from deepinfer.models.loader import StoredTensor, deliver
from deepinfer.models.weights import tensor_loader
from deepinfer.parallel.cp_batch import ContextParallelBatch

_ALIASES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def canonical_name(name: str) -> str:
    """Our key for a checkpoint name: no `model.` prefix; DeepSeek's own `<linear>.scale` is the
    fp8 block scale transformers calls `<linear>.weight_scale_inv` (mHC scales are `*_scale`, no dot)."""
    name = name.removeprefix("model.")
    if name.endswith(".scale"):
        return name[: -len(".scale")] + ".weight_scale_inv"
    return _ALIASES.get(name, name)


def v4_kv_cache_specs(cfg: DeepseekV4Config, dtype: torch.dtype, ring_margin: int = 0) -> list[KVCacheSpec]:
    """The hybrid cache: sliding-window keys (every layer), compressed entries per rate, indexer keys, with
    the compressors' per-sequence rings as state of the compressed groups. Depends on the config only.

    ring_margin: positions each ring holds beyond what the compressor needs (ring_len), so that a step may write
    that many positions past those later kept and be rolled back (speculative decoding's rejected drafts,
    KVCacheManager.state_rollback_tokens): the ring is indexed by position modulo its length, and a margin of k
    keeps the rejected positions' writes off every slot the position rolled back to still reads."""
    if ring_margin < 0:
        raise ValueError(f"ring_margin must be >= 0, got {ring_margin}")
    D, Di = cfg.head_dim, cfg.index_head_dim
    specs = [KVCacheSpec(name=SWA_GROUP, layer_ids=tuple(range(cfg.num_hidden_layers)), entry_shape=(D,),
                         dtype=dtype, sliding_window=cfg.sliding_window)]
    for t in (CSA, HCA):
        layers = cfg.layers_of(t)
        if not layers:
            continue
        m, overlap = cfg.compress_rates[t], t == CSA
        width = (2 if overlap else 1) * D
        specs.append(KVCacheSpec(name=COMP_GROUPS[t], layer_ids=layers, entry_shape=(D,), dtype=dtype,
                                 tokens_per_entry=m, state_shape=(ring_len(m, overlap) + ring_margin, 2 * width),
                                 state_dtype=dtype))
        if overlap:
            specs.append(KVCacheSpec(name=INDEX_GROUP, layer_ids=layers, entry_shape=(Di,), dtype=dtype,
                                     tokens_per_entry=m, state_shape=(ring_len(m, True) + ring_margin, 4 * Di),
                                     state_dtype=dtype))
    return specs


class V4Block(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_id: int, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        D, n = cfg.hidden_size, cfg.hc_mult
        self.attn = V4Attention(cfg, layer_id, backend, dtype)
        self.ffn = V4MoE(cfg, layer_id, backend, dtype)
        self.attn_hc = HyperConnection(n, D, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.ffn_hc = HyperConnection(n, D, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_norm: torch.Tensor | None = None
        self.ffn_norm: torch.Tensor | None = None
        self.backend = backend

    def loaders(self, p: str) -> dict[str, Loader]:
        dev, f32, D, n = self.backend.device, torch.float32, self.cfg.hidden_size, self.cfg.hc_mult
        out = self.attn.loaders(f"{p}.attn")
        out.update(self.ffn.loaders(f"{p}.ffn"))
        out[f"{p}.attn_norm.weight"] = tensor_loader(self, "attn_norm", f"{p}.attn_norm.weight", (D,), f32, dev)
        out[f"{p}.ffn_norm.weight"] = tensor_loader(self, "ffn_norm", f"{p}.ffn_norm.weight", (D,), f32, dev)
        width = (2 + n) * n
        for tag, hc in (("attn", self.attn_hc), ("ffn", self.ffn_hc)):
            for attr, shape in (("fn", (width, n * D)), ("base", (width,)), ("scale", (3,))):
                name = f"{p}.hc_{tag}_{attr}"
                out[name] = _param_loader(hc, attr, name, shape, dev)
        return out

    def finalize(self) -> None:
        self.attn.finalize()
        self.ffn.finalize()

    def forward(self, streams, token_ids, batch, caches, rope_memo: dict | None = None, state_snapshots=None,
                cp_step=None):
        eps = self.cfg.rms_norm_eps
        post, comb, x = self.attn_hc(streams)
        attn = self.attn(self.backend.v4_rms_norm(x, self.attn_norm, eps), batch, caches, rope_memo, state_snapshots,
                         cp_step)
        streams = hc_merge(streams, attn, post, comb)
        post, comb, x = self.ffn_hc(streams)
        return hc_merge(streams, self.ffn(self.backend.v4_rms_norm(x, self.ffn_norm, eps), token_ids), post, comb)


def _param_loader(module: nn.Module, attr: str, name: str, shape, device) -> Loader:
    def load(t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        getattr(module, attr).data = t.to(device=device, dtype=torch.float32)
    return load


class DeepseekV4ForCausalLM(CausalLM):
    model_type = "deepseek_v4"
    supports_tensor_parallel = True
    reads_stored_tensors = True
    supports_context_parallel = True  # a split step: cp_attention.py (and context_parallel_reasons)

    def __init__(self, config: dict | DeepseekV4Config, backend: Backend, dtype: torch.dtype):
        cfg = config if isinstance(config, DeepseekV4Config) else parse_v4_config(config)
        super().__init__(cfg, backend, dtype)
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        self.quantization = cfg.quantization
        self.mtp_weights: dict[str, torch.Tensor] = {}
        # MTP tensors not read: several ranks (nothing runs V4's MTP yet, and whole copies on every rank
        # would be the unsplit layer's memory each)
        self.skipped_mtp_tensors = 0
        self._one_rank = all(backend.communicator(g).world_size == 1 for g in ("tp", "ep"))
        D, n = cfg.hidden_size, cfg.hc_mult
        self.embed = VocabEmbedding(cfg.vocab_size, D, backend, dtype)
        self.layers = nn.ModuleList(V4Block(cfg, i, backend, dtype) for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(n, D, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm: torch.Tensor | None = None
        self.head = LMHead(cfg.vocab_size, D, backend, dtype)
        self._loaders = self._all_loaders()
        self._loaded: set[str] = set()
        # prefix caching: kv/state_snapshots.StateSnapshots, whose per-step plan names the block boundaries
        # at which the compressor ops save their rings (use_state_snapshots)
        self.state_snapshots = None

    def context_parallel_reasons(self) -> list[str]:
        """Why this model cannot split a prefill over cp ranks on its backend (empty: it can)."""
        return context_parallel_reasons([layer.attn for layer in self.layers])

    def use_state_snapshots(self, snapshots) -> None:
        """Have the compressors save their rings at the block boundaries of each step's plan (prefix caching)."""
        self.state_snapshots = snapshots

    # ------------------------------------------------------------ cache layout

    def kv_cache_specs(self, ring_margin: int = 0) -> list[KVCacheSpec]:
        """v4_kv_cache_specs; ring_margin: the rollback the compressors' rings allow (speculative decoding)."""
        return v4_kv_cache_specs(self.config, self.dtype, ring_margin)

    # ------------------------------------------------------------ weights

    def _all_loaders(self) -> dict[str, Loader]:
        dev, D = self.backend.device, self.config.hidden_size
        out: dict[str, Loader] = {}
        out.update(self.embed.loaders("embed"))
        out.update(self.head.loaders("head"))
        out["norm.weight"] = tensor_loader(self, "norm", "norm.weight", (D,), torch.float32, dev)
        n = self.config.hc_mult
        for attr, shape in (("hc_fn", (n, n * D)), ("hc_base", (n,)), ("hc_scale", (1,))):
            out[f"hc_head_{attr.removeprefix('hc_')}"] = _param_loader(self.hc_head, attr, f"hc_head_{attr[3:]}", shape, dev)
        for i, layer in enumerate(self.layers):
            out.update(layer.loaders(f"layers.{i}"))
        return out

    def _is_mtp(self, name: str) -> bool:
        if name.startswith("mtp."):
            return True
        m = re.match(r"layers\.(\d+)\.", name)
        return bool(m) and int(m.group(1)) >= self.config.num_hidden_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(name, tensor or unread StoredTensor) pairs; each needed tensor is read once, only this rank's part
        of it; a tensor another rank holds (OTHER_RANK) is expected but never read."""
        for raw, tensor in weights:
            name = canonical_name(raw)
            if self._is_mtp(name):
                if self._one_rank:
                    self.mtp_weights[name] = tensor.read() if isinstance(tensor, StoredTensor) else tensor
                else:
                    self.skipped_mtp_tensors += 1
                continue
            loader = self._loaders.get(name)
            if loader is None:
                raise ModelLoadError(f"unexpected tensor {raw!r} in a deepseek_v4 checkpoint")
            deliver(loader, tensor)
            self._loaded.add(name)

    def finalize(self) -> None:
        missing = sorted(set(self._loaders) - self._loaded)
        if self.config.tie_word_embeddings and "head.weight" in missing:
            self.head.tie_to(self.embed)
            missing.remove("head.weight")
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ModelLoadError(f"deepseek_v4 checkpoint lacks {missing[:5]}{more}")
        for layer in self.layers:
            layer.finalize()
        self.head.finalize()
        self._loaders = {}

    # ------------------------------------------------------------ forward

    def forward(self, batch, caches) -> torch.Tensor:
        ids = batch.input_ids
        x = self.embed(ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        rope_memo: dict = {}  # cos/sin of this step's positions, once per rotary branch, not once per layer
        snaps = self.state_snapshots
        if snaps is not None and snaps.plan is None:
            snaps = None  # no block boundary in this step
        cp_step = None
        if isinstance(batch, ContextParallelBatch):  # a split step: the snapshot plan is the whole step's
            cp_step, snaps = v4_split_step(batch, snaps), None
        for layer in self.layers:
            streams = layer(streams, ids, batch, caches, rope_memo, snaps, cp_step)
        return self.backend.v4_rms_norm(self.hc_head(streams), self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
