"""One DeepSeek-V4 decoder block: [mHC collapse -> RMSNorm -> attention -> mHC merge] then [mHC collapse ->
RMSNorm -> MoE -> mHC merge] over the hc_mult residual streams. The main model stacks them; an MTP module
(mtp.py) is one more at layer id num_hidden_layers + J."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.backend import Backend
from deepinfer.errors import ModelLoadError
from deepinfer.models.deepseek_v4.attention import V4Attention
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.hyper_connections import HyperConnection, hc_merge
from deepinfer.models.deepseek_v4.moe import V4MoE
from deepinfer.models.layers.linear import Loader
from deepinfer.models.weights import tensor_loader


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
                out[name] = param_loader(hc, attr, name, shape, dev)
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


def param_loader(module: nn.Module, attr: str, name: str, shape, device) -> Loader:
    def load(t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        getattr(module, attr).data = t.to(device=device, dtype=torch.float32)
    return load
