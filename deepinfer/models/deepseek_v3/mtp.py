"""DeepSeek-V3's multi-token prediction (MTP / NextN) module, as the released checkpoints store it.

Module k (k = 0 .. num_nextn_predict_layers - 1) lives at checkpoint layer index num_hidden_layers + k:
`enorm`, `hnorm`, `eh_proj`, a full decoder layer (`self_attn`, `mlp`, the two layer norms) and
`shared_head.norm`. The released V3 / R1 files also store copies of the embedding
(`embed_tokens`) and the output head (`shared_head.head`); the report shares them with the main model,
so when a checkpoint leaves them out (the embedded stdlib-coder does, to stay small) the main model's
are used, and when it stores them they are loaded and used as stored.

Math (DeepSeek-V3 report sec. 2.2; the input order is the one vLLM and SGLang use on the released
weights): for a token at position i with main-model final hidden state h_i (after the final norm) and
the next token t_{i+1},
    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])
    x = decoder_layer(x) at position i, over its own KV cache (layer id num_hidden_layers + k)
    logits_{i+2} = head(shared_head.norm(x))
The module's attention layer caches in the model's MLA group under its own layer id, so it shares the
block tables and slot mapping of the tokens it runs on.

Tensor parallelism: the decoder layer and the embedding / head copies split like the main model's; eh_proj
(2D -> D, small) is replicated on every rank, its input being the whole (replicated) hidden state.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.backend import Backend, ForwardBatch, KVCaches
from deepinfer.errors import ModelLoadError
from deepinfer.models.deepseek_v3.config import DeepseekConfig
from deepinfer.models.deepseek_v3.decoder_layer import DecoderLayer
from deepinfer.models.layers.embedding import LMHead, VocabEmbedding
from deepinfer.models.layers.linear import Linear, Loader
from deepinfer.models.weights import tensor_loader, then


class DeepseekMTP(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_id: int, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.dtype = dtype
        self.eps = cfg.rms_norm_eps
        D = cfg.hidden_size
        self.enorm: torch.Tensor | None = None
        self.hnorm: torch.Tensor | None = None
        self.shared_head_norm: torch.Tensor | None = None
        self.eh_proj = Linear(2 * D, D, backend, dtype, quantized=cfg.quantization == "fp8_block")
        self.block = DecoderLayer(cfg, layer_id, backend, dtype)
        # optional stored copies; None -> the main model's (set by `share`)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, D, backend, dtype)
        self.head = LMHead(cfg.vocab_size, D, backend, dtype)
        self._own_embed = self._own_head = False

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer_id}"

    def loaders(self) -> dict[str, Loader]:
        """Tensors every MTP checkpoint has."""
        p, dev, D = self.prefix, self.backend.device, self.block.hidden_size
        out = self.block.loaders(p)
        out.update(self.eh_proj.loaders(f"{p}.eh_proj"))
        for attr, name in (("enorm", f"{p}.enorm.weight"), ("hnorm", f"{p}.hnorm.weight"),
                           ("shared_head_norm", f"{p}.shared_head.norm.weight")):
            out[name] = tensor_loader(self, attr, name, (D,), self.dtype, dev)
        return out

    def optional_loaders(self) -> dict[str, Loader]:
        """The embedding and head copies the released checkpoints carry (the main model's otherwise), and the fp8
        KV cache's scales of its attention (models/layers/kv_scale.py)."""
        p = self.prefix
        out: dict[str, Loader] = self.block.optional_loaders(p)
        for name, load in self.embed_tokens.loaders(f"{p}.embed_tokens").items():
            out[name] = self._mark(load, "_own_embed")
        for name, load in self.head.loaders(f"{p}.shared_head.head").items():
            out[name] = self._mark(load, "_own_head")
        return out

    def _mark(self, load: Loader, flag: str) -> Loader:
        return then(load, lambda: setattr(self, flag, True))

    def finalize(self, main_embed: VocabEmbedding, main_head: LMHead) -> None:
        if not self._own_embed:
            self.embed_tokens = main_embed
        if not self._own_head:
            self.head = main_head
        else:
            self.head.finalize()
        if self.head.weight is None:
            raise ModelLoadError(f"{self.prefix}: no output head (shared_head.head) and none to share")
        self.eh_proj.finalize()
        self.block.finalize()

    def forward(self, hidden: torch.Tensor, next_input_ids: torch.Tensor, positions: torch.Tensor,
                rope_cache: torch.Tensor, batch: ForwardBatch, caches: KVCaches) -> torch.Tensor:
        """hidden [T, D]: the main model's final (normed) hidden states; next_input_ids [T]: the token after
        each; positions [T]: the hidden states' positions. Returns the normed state whose logits are the
        draft for two tokens ahead."""
        be = self.backend
        e = be.rms_norm(self.embed_tokens(next_input_ids), self.enorm, self.eps)
        h = be.rms_norm(hidden, self.hnorm, self.eps)
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        x, residual = self.block(x, None, positions, rope_cache, batch, caches)
        x, _ = be.add_rms_norm(x, residual, self.shared_head_norm, self.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
