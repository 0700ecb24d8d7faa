"""DeepSeek V2 / V2-Lite / V3 / R1 / V3.1 (model_type deepseek_v2 and deepseek_v3): one causal LM class.

The families differ only in config (q compression, routing, rope interleave),
all resolved by `parse_deepseek_config`; the math is written against the
backend contract, so every backend runs this same file.

Tensor parallelism (the backend's "tp" communicator): the layers split themselves (heads, dense MLP and
shared experts, vocabulary; layers/*.py); their loaders name the part of each tensor this rank reads, and
`load_weights` takes the checkpoint's unread handles and reads just those parts (loader.deliver).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from deepinfer.backend import Backend, ForwardBatch, KVCaches, KVCacheSpec
from deepinfer.backend.native.rope import rope_cos_sin_cache
from deepinfer.errors import ModelLoadError
from deepinfer.models.base import CausalLM
from deepinfer.models.deepseek_v3.config import DeepseekConfig, parse_deepseek_config
from deepinfer.models.deepseek_v3.decoder_layer import DecoderLayer
from deepinfer.models.deepseek_v3.mtp import DeepseekMTP
from deepinfer.models.layers.embedding import LMHead, VocabEmbedding
from deepinfer.models.layers.linear import Loader
from deepinfer.models.layers.mla import MLA_GROUP
from deepinfer.models.loader import deliver
from deepinfer.models.weights import tensor_loader

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_MAX_LISTED = 20


class DeepseekV2ForCausalLM(CausalLM):
    """Serves model_type deepseek_v2 and deepseek_v3. `config` is the config.json dict (or a parsed config).

    load_mtp: build the checkpoint's MTP modules (`self.mtp`, see mtp.py) and load their tensors; an MTP
    checkpoint must then hold every module the config declares. Off (the default while nothing drafts
    with them), MTP tensors are skipped unread and counted in `skipped_mtp_tensors`.
    """

    loads_mtp = True
    supports_tensor_parallel = True
    supports_context_parallel = True  # MLA takes a ContextParallelBatch (models/layers/cp_attention.py)
    reads_stored_tensors = True

    def __init__(self, config: dict | DeepseekConfig, backend: Backend, dtype: torch.dtype,
                 load_mtp: bool = False):
        cfg = config if isinstance(config, DeepseekConfig) else parse_deepseek_config(config)
        super().__init__(cfg, backend, dtype)
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        self.model_type = cfg.model_type
        self.quantization = cfg.quantization
        self.num_layers = cfg.num_hidden_layers
        self.skipped_mtp_tensors = 0
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, backend, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, dtype) for i in range(cfg.num_hidden_layers))
        self.norm: torch.Tensor | None = None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, backend, dtype)
        if load_mtp and not cfg.num_nextn_predict_layers:
            raise ModelLoadError("load_mtp=True but config.json declares no MTP module (num_nextn_predict_layers 0)")
        n_mtp = cfg.num_nextn_predict_layers if load_mtp else 0
        self.mtp = nn.ModuleList(DeepseekMTP(cfg, cfg.num_hidden_layers + k, backend, dtype) for k in range(n_mtp))
        self.rope_cache = rope_cos_sin_cache(
            cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        ).to(backend.device)
        self._finalized = False

    # ------------------------------------------------------------ weights

    def weight_loaders(self) -> dict[str, Loader]:
        """Every checkpoint tensor name this model needs -> its setter."""
        cfg = self.config
        out = self.embed_tokens.loaders("model.embed_tokens")
        for i, layer in enumerate(self.layers):
            out.update(layer.loaders(f"model.layers.{i}"))
        out["model.norm.weight"] = tensor_loader(self, "norm", "model.norm.weight", (cfg.hidden_size,), self.dtype,
                                                 self.backend.device)
        if not cfg.tie_word_embeddings:
            out.update(self.lm_head.loaders("lm_head"))
        return out

    def is_mtp_weight(self, name: str) -> bool:
        """MTP (next-n) layers sit after the decoder: model.layers.{num_hidden_layers + k}.*"""
        m = _LAYER_RE.match(name)
        return m is not None and int(m.group(1)) >= self.num_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(name, tensor or unread StoredTensor) pairs; each needed tensor is read once, only this rank's part
        of it; a tensor another rank holds (OTHER_RANK) is expected but never read."""
        expected = self.weight_loaders()
        optional: dict[str, Loader] = {}
        for i, layer in enumerate(self.layers):  # the fp8 KV cache's scales (models/layers/kv_scale.py)
            optional.update(layer.optional_loaders(f"model.layers.{i}"))
        for m in self.mtp:
            expected.update(m.loaders())
            optional.update(m.optional_loaders())
        unexpected: list[str] = []
        for name, tensor in weights:
            loader = expected.pop(name, None) or optional.pop(name, None)
            if loader is not None:
                deliver(loader, tensor)
            elif self.is_mtp_weight(name) and not self.mtp:
                self.skipped_mtp_tensors += 1
            elif cfg_tied_head(self.config, name):
                continue  # some tied checkpoints still store lm_head.weight; the embedding is used
            else:
                unexpected.append(name)
        problems = []
        if expected:
            problems.append(f"missing tensors ({len(expected)}): {_listing(sorted(expected))}")
        if unexpected:
            problems.append(f"unexpected tensors ({len(unexpected)}): {_listing(sorted(unexpected))}")
        if problems:
            raise ModelLoadError("checkpoint does not match config.json: " + "; ".join(problems))

    def finalize(self) -> None:
        if self._finalized:
            return
        for layer in self.layers:
            layer.finalize()
        if self.config.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)
        self.lm_head.finalize()
        for m in self.mtp:
            m.finalize(self.embed_tokens, self.lm_head)
        self._finalized = True

    # ------------------------------------------------------------ run

    def kv_cache_specs(self, include_mtp: bool = False,
                       kv_cache_dtype: torch.dtype | None = None) -> list[KVCacheSpec]:
        """include_mtp: also cache for the MTP modules' attention (layer ids num_hidden_layers + k).
        kv_cache_dtype: the storage dtype (EngineConfig.kv_cache_dtype; None = the compute dtype). An fp8
        cache (float8_e4m3fn, MTP layers included) is quantized / dequantized by the MLA ops themselves,
        which see it in the cache tensor's dtype; the planner counts its 1-byte entries."""
        cfg = self.config
        n_layers = cfg.num_hidden_layers + (len(self.mtp) if include_mtp else 0)
        if kv_cache_dtype not in (None, self.dtype, torch.float8_e4m3fn):
            raise ModelLoadError(f"KV cache dtype {kv_cache_dtype} is not supported for the MLA cache "
                                 f"(the compute dtype {self.dtype} or torch.float8_e4m3fn)")
        return [
            KVCacheSpec(
                name=MLA_GROUP,
                layer_ids=tuple(range(n_layers)),
                entry_shape=(cfg.kv_lora_rank + cfg.qk_rope_head_dim,),
                dtype=self.dtype if kv_cache_dtype is None else kv_cache_dtype,
                components=(("latent", cfg.kv_lora_rank), ("rope", cfg.qk_rope_head_dim)),
            )
        ]

    def forward(self, batch: ForwardBatch, caches: KVCaches) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch.positions, self.rope_cache, batch, caches)
        x, _ = self.backend.add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def mtp_forward(self, hidden: torch.Tensor, next_input_ids: torch.Tensor, batch: ForwardBatch,
                    caches: KVCaches, k: int = 0) -> torch.Tensor:
        """MTP module k over the batch's tokens: `hidden` from `forward`, `next_input_ids` the token after
        each (see mtp.py); caches must come from kv_cache_specs(include_mtp=True)."""
        if k >= len(self.mtp):
            raise ModelLoadError(f"MTP module {k} is not loaded (built with load_mtp={bool(self.mtp)}, "
                                 f"{len(self.mtp)} modules)")
        return self.mtp[k](hidden, next_input_ids, batch.positions, self.rope_cache, batch, caches)

    def mtp_logits(self, hidden: torch.Tensor, k: int = 0) -> torch.Tensor:
        return self.mtp[k].compute_logits(hidden)


def cfg_tied_head(cfg: DeepseekConfig, name: str) -> bool:
    return cfg.tie_word_embeddings and name == "lm_head.weight"


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")
