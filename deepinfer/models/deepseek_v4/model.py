"""DeepSeek-V4 causal LM (V4-Flash, V4-Pro, V4.1-Flash) over the hybrid paged KV cache.

embed -> hc_mult residual streams -> per layer: [mHC collapse -> RMSNorm ->
attention -> mHC merge] then [mHC collapse -> RMSNorm -> MoE -> mHC merge]
-> HyperHead collapse -> RMSNorm -> head. Checkpoint names are DeepSeek's
release names (`embed.weight`, `layers.N.attn.wq_a.weight`, `mtp.0.*`, ...);
a leading `model.` and transformers' names for the top-level tensors are
accepted too. Built with load_mtp=True, the MTP modules (`mtp.J.*`, mtp.py) are loaded and run as speculative
decoding's drafter; otherwise their tensors are kept aside in `mtp_weights` (one rank only: see load_weights).

Many ranks (docs/parallelism.md): attention heads split over "tp" (attention.py, parallel.py), routed
experts split over "tp" or spread over "ep" (moe.py), the vocabulary split (embedding / head); the
hyper-connections, norms and the router gates act on the whole hidden state and are replicated. Each
loader names the part of its tensor this rank reads; `load_weights` takes the checkpoint's unread handles
and reads just those parts (models/loader.deliver). Context-parallel prefill: a split step (a
ContextParallelBatch) runs this rank's tokens; its attention layers share their KV inputs (cp_attention.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from deepinfer.backend import Backend, KVCacheSpec
from deepinfer.backend.native.v4_compressor import ring_len
from deepinfer.errors import ModelLoadError
from deepinfer.models.base import CausalLM
from deepinfer.models.deepseek_v4.attention import COMP_GROUPS, INDEX_GROUP, SWA_GROUP
from deepinfer.models.deepseek_v4.block import V4Block, param_loader
from deepinfer.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config, parse_v4_config
from deepinfer.models.deepseek_v4.cp_attention import context_parallel_reasons, v4_split_step
from deepinfer.models.deepseek_v4.hyper_connections import HyperHead
from deepinfer.models.deepseek_v4.mtp import V4MTP
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


def v4_kv_cache_specs(cfg: DeepseekV4Config, dtype: torch.dtype, ring_margin: int = 0,
                      num_mtp: int = 0) -> list[KVCacheSpec]:
    """The hybrid cache: sliding-window keys (every layer), compressed entries per rate, indexer keys, with
    the compressors' per-sequence rings as state of the compressed groups. Depends on the config only.

    num_mtp: also cache for the first num_mtp MTP modules (layer ids num_hidden_layers + J, each in the window
    group and in the groups of its layer type, `DeepseekV4Config.mtp_layer_types`).

    ring_margin: positions each ring holds beyond what the compressor needs (ring_len), so that a step may write
    that many positions past those later kept and be rolled back (speculative decoding's rejected drafts,
    KVCacheManager.state_rollback_tokens): the ring is indexed by position modulo its length, and a margin of k
    keeps the rejected positions' writes off every slot the position rolled back to still reads."""
    if ring_margin < 0:
        raise ValueError(f"ring_margin must be >= 0, got {ring_margin}")
    if num_mtp > len(cfg.mtp_layer_types):
        raise ValueError(f"num_mtp={num_mtp}: the config schedules {len(cfg.mtp_layer_types)} MTP layers")
    D, Di = cfg.head_dim, cfg.index_head_dim
    L = cfg.num_hidden_layers
    mtp = {L + j: t for j, t in enumerate(cfg.mtp_layer_types[:num_mtp])}
    specs = [KVCacheSpec(name=SWA_GROUP, layer_ids=tuple(range(L + num_mtp)), entry_shape=(D,),
                         dtype=dtype, sliding_window=cfg.sliding_window)]
    for t in (CSA, HCA):
        layers = cfg.layers_of(t) + tuple(i for i, ti in mtp.items() if ti == t)
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


class DeepseekV4ForCausalLM(CausalLM):
    model_type = "deepseek_v4"
    supports_tensor_parallel = True
    reads_stored_tensors = True
    supports_context_parallel = True  # a split step: cp_attention.py (and context_parallel_reasons)
    loads_mtp = True  # load_model(..., load_mtp=True): the MTP modules as speculative decoding's drafter

    def __init__(self, config: dict | DeepseekV4Config, backend: Backend, dtype: torch.dtype, load_mtp: bool = False):
        """load_mtp: build the checkpoint's MTP modules (`self.mtp`, mtp.py) and load their tensors (over several
        ranks each module's block splits like a main layer's; e_proj / h_proj and the stream collapse are
        replicated). Without it the MTP tensors are read into `mtp_weights` and kept aside on one rank, and skipped
        unread (`skipped_mtp_tensors`) on several."""
        cfg = config if isinstance(config, DeepseekV4Config) else parse_v4_config(config)
        super().__init__(cfg, backend, dtype)
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        self.quantization = cfg.quantization
        self.mtp_weights: dict[str, torch.Tensor] = {}
        # MTP tensors not read: several ranks without load_mtp (whole copies on every rank would be the unsplit
        # layer's memory each)
        self.skipped_mtp_tensors = 0
        self._one_rank = all(backend.communicator(g).world_size == 1 for g in ("tp", "ep"))
        if load_mtp:
            _check_mtp(cfg)
        D, n = cfg.hidden_size, cfg.hc_mult
        self.embed = VocabEmbedding(cfg.vocab_size, D, backend, dtype)
        self.layers = nn.ModuleList(V4Block(cfg, i, backend, dtype) for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(n, D, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm: torch.Tensor | None = None
        self.head = LMHead(cfg.vocab_size, D, backend, dtype)
        n_mtp = cfg.num_nextn_predict_layers if load_mtp else 0
        mtp_cfg = cfg.with_mtp_layers() if n_mtp else cfg
        self.mtp = nn.ModuleList(V4MTP(mtp_cfg, j, backend, dtype) for j in range(n_mtp))
        # the streams of the last forward, flat, for the MTP pass (`mtp_input`); only with MTP modules
        self._streams: tuple[torch.Tensor, torch.Tensor] | None = None
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

    def kv_cache_specs(self, ring_margin: int = 0, include_mtp: bool = False) -> list[KVCacheSpec]:
        """v4_kv_cache_specs; ring_margin: the rollback the compressors' rings allow (speculative decoding);
        include_mtp: also the loaded MTP modules' layers (MTP drafting)."""
        return v4_kv_cache_specs(self.config, self.dtype, ring_margin, len(self.mtp) if include_mtp else 0)

    # ------------------------------------------------------------ weights

    def _all_loaders(self) -> dict[str, Loader]:
        dev, D = self.backend.device, self.config.hidden_size
        out: dict[str, Loader] = {}
        out.update(self.embed.loaders("embed"))
        out.update(self.head.loaders("head"))
        out["norm.weight"] = tensor_loader(self, "norm", "norm.weight", (D,), torch.float32, dev)
        n = self.config.hc_mult
        for attr, shape in (("hc_fn", (n, n * D)), ("hc_base", (n,)), ("hc_scale", (1,))):
            out[f"hc_head_{attr.removeprefix('hc_')}"] = param_loader(self.hc_head, attr, f"hc_head_{attr[3:]}", shape, dev)
        for i, layer in enumerate(self.layers):
            out.update(layer.loaders(f"layers.{i}"))
        for m in self.mtp:
            out.update(m.loaders())
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
            if self._is_mtp(name) and not (self.mtp and name in self._loaders):
                if self.mtp:
                    raise ModelLoadError(f"unexpected MTP tensor {raw!r} in a deepseek_v4 checkpoint (the MTP "
                                         f"modules read mtp.J.* for J < {len(self.mtp)})")
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
        for m in self.mtp:
            m.share(self.embed, self.head)
            m.finalize()
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
        out = self.backend.v4_rms_norm(self.hc_head(streams), self.norm, self.config.rms_norm_eps)
        if self.mtp:  # the MTP pass reads the streams, not the collapsed state (mtp.py)
            self._streams = (out, streams.flatten(1))
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    # ------------------------------------------------------------ MTP (speculative decoding's drafter)

    @property
    def mtp_hidden_size(self) -> int:
        """Width of an MTP input row: the hc_mult residual streams, flat."""
        return self.config.hc_mult * self.config.hidden_size

    def mtp_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP pass's input rows for `hidden`, which must be what the last `forward` returned: its residual
        streams after the last block, flat [T, hc_mult * D] (V4's MTP reads them before the final collapse)."""
        if self._streams is None or self._streams[0] is not hidden:
            raise RuntimeError("DeepseekV4ForCausalLM.mtp_input: `hidden` is not the last forward's output (the "
                               "MTP pass must follow the forward whose states it reads)")
        return self._streams[1]

    def release_mtp_input(self) -> None:
        """Drop the last forward's streams (held for the MTP pass: [T, hc_mult * D] of a whole prefill step)."""
        self._streams = None

    def mtp_forward(self, hidden: torch.Tensor, next_input_ids: torch.Tensor, batch, caches,
                    k: int = 0) -> torch.Tensor:
        """MTP module k over the batch's tokens: `hidden` from `mtp_input` (or module k's own output one position
        back), `next_input_ids` the token after each (mtp.py); caches from kv_cache_specs(include_mtp=True). The
        prefix cache's ring snapshots are taken where the batch's plan names boundaries (`state_snapshots.plan`,
        set for the MTP pass by its drafter)."""
        if k >= len(self.mtp):
            raise ModelLoadError(f"MTP module {k} is not loaded (built with load_mtp={bool(self.mtp)}, "
                                 f"{len(self.mtp)} modules)")
        snaps = self.state_snapshots
        if snaps is not None and snaps.plan is None:
            snaps = None
        return self.mtp[k](hidden, next_input_ids, batch, caches, snaps)

    def mtp_logits(self, state: torch.Tensor, k: int = 0) -> torch.Tensor:
        return self.mtp[k].logits(state)


def _check_mtp(cfg: DeepseekV4Config) -> None:
    """What building the MTP modules needs (load_mtp=True): an error naming the field, never a fallback."""
    if not cfg.num_nextn_predict_layers:
        raise ModelLoadError("load_mtp=True but config.json declares no MTP module (num_nextn_predict_layers 0)")
    if len(cfg.mtp_layer_types) < cfg.num_nextn_predict_layers:
        raise ModelLoadError(f"load_mtp=True: config.json num_nextn_predict_layers={cfg.num_nextn_predict_layers} "
                             f"but compress_ratios schedules {len(cfg.mtp_layer_types)} MTP layers past the "
                             f"{cfg.num_hidden_layers} main ones (each MTP module's attention type is its entry)")
