"""DeepSeek-V4's multi-token prediction (MTP) module, as the release stores it (`mtp.J.*`).

Module J is a whole V4 block (attention with its compressors, MoE, both hyper-connections) at layer id
num_hidden_layers + J, with its own `enorm`, `hnorm`, `e_proj`, `h_proj`, final `norm` and stream collapse
(`hc_head_fn / _base / _scale`); the embedding and the output head are the main model's. Its layer type (sliding,
CSA or HCA) is the entry of `compress_ratios` past the main layers; its MoE is a plain top-k MoE (the hash layers
are the first ones).

Math (DeepSeek's V4 inference code, `MTPBlock.forward`; vLLM's deepseek_v4_mtp reads the release the same way):
for the token at position i, with the main model's residual streams h_i [hc_mult, D] after its last block (before
the final collapse) and the next token t_{i+1},
    x   = e_proj(enorm(embed(t_{i+1}))) broadcast over the streams + h_proj(hnorm(h_i))   (per stream)
    x   = block(x) at position i, over the module's own KV cache and compressor rings
    out = head(norm(hc_head(x)))   the draft for position i + 2
So the module's state is streams like the main model's residual, which the chain (spec/mtp_drafter.py) feeds back
in place of h for the next link, as vLLM does. The engine hands the streams around flat ([T, hc_mult * D],
`DeepseekV4ForCausalLM.mtp_input`).

Its cache: the module's attention caches in the model's groups under its own layer id (the sliding window, and the
compressed / indexer groups of its type with their rings; `v4_kv_cache_specs(mtp_layers=...)`), so it shares the
block tables, slot mappings and state rows of the tokens it runs on, and the rings' rollback margin.

Many ranks: the block splits like a main layer's (heads over "tp", experts over "tp" or "ep"); e_proj / h_proj
(D x D) and the stream collapse are replicated, their inputs being the whole (replicated) streams and embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.backend import Backend
from deepinfer.models.deepseek_v4.block import V4Block, param_loader
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.hyper_connections import HyperHead
from deepinfer.models.layers.embedding import LMHead, VocabEmbedding
from deepinfer.models.layers.linear import Linear, Loader
from deepinfer.models.weights import tensor_loader


class V4MTP(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, index: int, backend: Backend, dtype: torch.dtype):
        """cfg: the model's config with the MTP layers' schedule appended (`DeepseekV4Config.with_mtp_layers`);
        index: J of `mtp.J.*` (layer id num_hidden_layers + J)."""
        super().__init__()
        self.cfg = cfg
        self.index = index
        self.layer_id = cfg.num_hidden_layers + index
        self.backend = backend
        self.dtype = dtype
        D, n = cfg.hidden_size, cfg.hc_mult
        self.D, self.n = D, n
        q8 = cfg.quantization == "fp8_block"
        self.block = V4Block(cfg, self.layer_id, backend, dtype)
        self.e_proj = Linear(D, D, backend, dtype, quantized=q8)
        self.h_proj = Linear(D, D, backend, dtype, quantized=q8)
        self.enorm: torch.Tensor | None = None
        self.hnorm: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.hc_head = HyperHead(n, D, cfg.hc_eps, cfg.rms_norm_eps)
        self.embed: VocabEmbedding | None = None  # the main model's (`share`)
        self.head: LMHead | None = None

    @property
    def prefix(self) -> str:
        return f"mtp.{self.index}"

    def loaders(self) -> dict[str, Loader]:
        p, dev, f32, D, n = self.prefix, self.backend.device, torch.float32, self.D, self.n
        out = self.block.loaders(p)
        out.update(self.e_proj.loaders(f"{p}.e_proj"))
        out.update(self.h_proj.loaders(f"{p}.h_proj"))
        for attr in ("enorm", "hnorm", "norm"):
            name = f"{p}.{attr}.weight"
            out[name] = tensor_loader(self, attr, name, (D,), f32, dev)
        for attr, shape in (("hc_fn", (n, n * D)), ("hc_base", (n,)), ("hc_scale", (1,))):
            name = f"{p}.hc_head_{attr[3:]}"
            out[name] = param_loader(self.hc_head, attr, name, shape, dev)
        return out

    def share(self, embed: VocabEmbedding, head: LMHead) -> None:
        """The main model's embedding and head (the release stores no copies under mtp.*)."""
        self.embed, self.head = embed, head

    def finalize(self) -> None:
        self.block.finalize()
        self.e_proj.finalize()
        self.h_proj.finalize()

    def forward(self, hidden: torch.Tensor, next_input_ids: torch.Tensor, batch, caches,
                state_snapshots=None) -> torch.Tensor:
        """hidden [T, hc_mult * D]: the main model's streams after its last block (or this module's own output,
        one position back, in a chain); next_input_ids [T]: the token after each; batch: at the hidden states'
        positions. Returns this module's streams [T, hc_mult * D] (`logits` turns them into the draft)."""
        be, eps, T = self.backend, self.cfg.rms_norm_eps, hidden.shape[0]
        e = be.v4_rms_norm(self.embed(next_input_ids), self.enorm, eps)
        h = be.v4_rms_norm(hidden.view(T * self.n, self.D).to(self.dtype), self.hnorm, eps)
        x = (self.h_proj(h).view(T, self.n, self.D) + self.e_proj(e).unsqueeze(1)).contiguous()
        streams = self.block(x, next_input_ids, batch, caches, None, state_snapshots)
        return streams.reshape(T, self.n * self.D)

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Draft logits from this module's streams [T, hc_mult * D]: collapse, norm, the shared head."""
        y = self.hc_head(state.view(state.shape[0], self.n, self.D))
        return self.head(self.backend.v4_rms_norm(y, self.norm, self.cfg.rms_norm_eps))
