"""One DeepSeek V2/V3 decoder layer: MLA, then a dense MLP or the MoE, each behind a pre-norm residual."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.backend import Backend, ForwardBatch, Fp8Act, KVCaches
from deepinfer.models.deepseek_v3.config import DeepseekConfig
from deepinfer.models.layers.linear import Loader
from deepinfer.models.layers.mla import MLAAttention
from deepinfer.models.layers.mlp import GatedMLP
from deepinfer.models.layers.moe import MoELayer
from deepinfer.models.layers.quant import fused_act_quant
from deepinfer.models.weights import tensor_loader


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
        self.fp8_norm_quant = fused_act_quant()  # the config file's fuse_quant_dequant, else the env knob
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

    def optional_loaders(self, prefix: str) -> dict[str, Loader]:
        """Tensors a checkpoint may carry for this layer: its attention's fp8 KV-cache scales."""
        return self.self_attn.optional_loaders(f"{prefix}.self_attn")

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
        x, residual = self._pre_norm(x, residual, self.input_layernorm, self.self_attn)
        x = self.self_attn(x, positions, rope_cache, batch, caches)
        x, residual = self._pre_norm(x, residual, self.post_attention_layernorm, self.mlp)
        return self.mlp(x), residual

    def _pre_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  consumer: nn.Module) -> tuple[torch.Tensor | Fp8Act, torch.Tensor]:
        """(norm(x + residual), x + residual); the first layer has no residual yet (x is it). When the consumer
        reads fp8 W8A8 activations at this token count, the norm also writes their quantization (Fp8Act: one
        pass over each row instead of a separate act-quant kernel per consumer; fuse_quant_dequant: true in the
        config file or DEEPINFER_FP8_EPILOGUE_QUANT=1 turns it on). The choice depends on the token count alone,
        so it is fixed per CUDA graph."""
        if self.fp8_norm_quant and consumer.takes_fp8_act(x.shape[0]):
            act, total = self.backend.rms_norm_fp8(x, residual, weight, self.eps)
            return act, (x if residual is None else total)
        if residual is None:
            return self.backend.rms_norm(x, weight, self.eps), x
        return self.backend.add_rms_norm(x, residual, weight, self.eps)
