"""DeepSeek V2 / V2-Lite / V3 / R1 / V3.1 (model_type deepseek_v2 and deepseek_v3): one causal LM class.

The families differ only in config (q compression, routing, rope interleave),
all resolved by `parse_deepseek_config`; the math is written against the
backend contract, so every backend runs this same file.
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
from deepinfer.models.layers.embedding import LMHead, VocabEmbedding
from deepinfer.models.layers.linear import Loader
from deepinfer.models.layers.mla import MLA_GROUP, MLAAttention
from deepinfer.models.layers.mlp import GatedMLP
from deepinfer.models.layers.moe import MoELayer
from deepinfer.models.weights import tensor_loader

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_MAX_LISTED = 20


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_id: int, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.backend = backend
        self.dtype = dtype
        self.eps = cfg.rms_norm_eps
        self.hidden_size = cfg.hidden_size
        self.self_attn = MLAAttention(cfg, layer_id, backend, dtype)
        quant = cfg.quantization == "fp8_block"
        self.mlp: nn.Module = (
            MoELayer(cfg, backend, dtype)
            if cfg.is_moe_layer(layer_id)
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, backend, dtype, quantized=quant)
        )
        self.input_layernorm: torch.Tensor | None = None
        self.post_attention_layernorm: torch.Tensor | None = None

    def loaders(self, prefix: str) -> dict[str, Loader]:
        dev, D = self.backend.device, self.hidden_size
        out = self.self_attn.loaders(f"{prefix}.self_attn")
        out.update(self.mlp.loaders(f"{prefix}.mlp"))
        for attr in ("input_layernorm", "post_attention_layernorm"):
            name = f"{prefix}.{attr}.weight"
            out[name] = tensor_loader(self, attr, name, (D,), self.dtype, dev)
        return out

    def finalize(self) -> None:
        self.self_attn.finalize()
        self.mlp.finalize()

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope_cache: torch.Tensor,
        batch: ForwardBatch,
        caches: KVCaches,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.backend.rms_norm(x, self.input_layernorm, self.eps)
        else:
            x, residual = self.backend.add_rms_norm(x, residual, self.input_layernorm, self.eps)
        x = self.self_attn(x, positions, rope_cache, batch, caches)
        x, residual = self.backend.add_rms_norm(x, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(x), residual


class DeepseekV2ForCausalLM(CausalLM):
    """Serves model_type deepseek_v2 and deepseek_v3. `config` is the config.json dict (or a parsed config)."""

    def __init__(self, config: dict | DeepseekConfig, backend: Backend, dtype: torch.dtype):
        cfg = config if isinstance(config, DeepseekConfig) else parse_deepseek_config(config)
        super().__init__(cfg, backend, dtype)
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        self.model_type = cfg.model_type
        self.quantization = cfg.quantization
        self.num_layers = cfg.num_hidden_layers
        self.mtp_weights: dict[str, torch.Tensor] = {}
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, backend, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, dtype) for i in range(cfg.num_hidden_layers))
        self.norm: torch.Tensor | None = None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, backend, dtype)
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
        expected = self.weight_loaders()
        unexpected: list[str] = []
        for name, tensor in weights:
            loader = expected.pop(name, None)
            if loader is not None:
                loader(tensor)
            elif self.is_mtp_weight(name):
                self.mtp_weights[name] = tensor
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
        self._finalized = True

    # ------------------------------------------------------------ run

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        cfg = self.config
        return [
            KVCacheSpec(
                name=MLA_GROUP,
                layer_ids=tuple(range(cfg.num_hidden_layers)),
                entry_shape=(cfg.kv_lora_rank + cfg.qk_rope_head_dim,),
                dtype=self.dtype,
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


def cfg_tied_head(cfg: DeepseekConfig, name: str) -> bool:
    return cfg.tie_word_embeddings and name == "lm_head.weight"


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")
