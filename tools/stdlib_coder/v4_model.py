"""A trainable DeepSeek-V4 with one MTP module, for stdlib-coder-v4: a small V4 trained on the same corpus and tokenizer
as the embedded stdlib-coder, so V4's MTP drafting has a model whose drafts mean something (issue 17: a random V4's
drafts are accepted at chance).

The math is transformers' DeepSeek-V4 (test-only elsewhere; here a training tool's dependency, never the engine's):
a `DeepseekV4ForCausalLM` one layer deeper than the model, whose last layer is the MTP module's block, as the V4 MTP
test's reference builds it (tests/v4/test_v4_mtp.py). `losses` runs the main layers over the window, then the MTP
block over the main streams fused with the next tokens' embeddings, as DeepSeek's `MTPBlock.forward` does (enorm /
e_proj on the embedding, hnorm / h_proj on every stream, the sum fed to the block, its own stream collapse and norm,
the shared head). `export` writes DeepSeek's V4 checkpoint names (what deepinfer and transformers both load), the
module as `mtp.0.*`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.checkpoints.presets_v4 import v4_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MTP_OWN = ("enorm", "hnorm", "norm", "e_proj", "h_proj")  # the MTP module's tensors outside its block


INDEX_TOPK = 256  # CSA entries each query keeps: every entry up to 1,024 tokens (m = 4)


def stdlib_v4_config(vocab_size: int) -> dict:
    """Four main layers (sliding window, CSA m=4, HCA m=16, CSA) and one MTP layer (CSA), hidden 128, 8 experts
    (top 2) and one shared, the first layer hash-routed; a 32-token window. ~3 M parameters: trainable on a CPU in
    tens of minutes.

    The lightning indexer is not trained (DeepSeek trains it apart, against the attention's own distribution; its
    top-k pick passes no gradient), so its scores stay near their init's and near-tied: two implementations that
    round a score differently then keep different entries (transformers and deepinfer differed by up to 1.3 in a
    logit past ~45 tokens with a top 8, the first checkpoint trained this session). INDEX_TOPK keeps every entry
    within the contexts the model is run at (the benchmarks' 512 tokens), so the indexer decides nothing there; the
    compressors, the window, HCA, hash routing and the hyper-connections all do."""
    return v4_config(vocab=vocab_size, hidden=128, layers_ratios=(0, 4, 16, 4), mtp_ratios=(4,), hash_layers=1,
                      heads=4, head_dim=32, rope_dim=16, q_lora=64, o_groups=2, o_lora=32, experts=8, top_k=2,
                      moe_inter=96, window=32, csa=4, hca=16, index_heads=4, index_dim=16, index_topk=INDEX_TOPK,
                      yarn_factor=4.0, yarn_original=1024, max_pos=4096)


def _layer_type(cfg: dict, ratio: int) -> str:
    rates = cfg["compress_rates"]
    return {0: "sliding_attention", rates["compressed_sparse_attention"]: "compressed_sparse_attention",
            rates["heavily_compressed_attention"]: "heavily_compressed_attention"}[ratio]


def cross_entropies(tokens: torch.Tensor, logits: torch.Tensor, mtp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_logits' outputs against the window's own tokens: (next-token, next-next-token) cross-entropy."""
    V = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
    return main, F.cross_entropy(mtp[:, :-1].reshape(-1, V), tokens[:, 2:].reshape(-1))


class TrainingV4(nn.Module):
    """The model (transformers' V4 with the MTP block as layer L) and the MTP module's own tensors."""

    def __init__(self, cfg: dict, seed: int):
        super().__init__()
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead, DeepseekV4RMSNorm

        self.cfg = cfg
        L = self.num_layers = cfg["num_hidden_layers"]
        if cfg["num_nextn_predict_layers"] != 1:
            raise ValueError("TrainingV4 trains exactly one MTP layer")
        hf_cfg = {**cfg, "num_hidden_layers": L + 1, "num_nextn_predict_layers": 0,
                  "layer_types": cfg["layer_types"] + [_layer_type(cfg, cfg["compress_ratios"][L])],
                  "mlp_layer_types": cfg["mlp_layer_types"] + ["moe"]}
        torch.manual_seed(seed)
        self.hf = DeepseekV4ForCausalLM(DeepseekV4Config(**hf_cfg)).float()
        D = cfg["hidden_size"]
        self.mtp = nn.ModuleDict({"enorm": DeepseekV4RMSNorm(D), "hnorm": DeepseekV4RMSNorm(D),
                                  "norm": DeepseekV4RMSNorm(D), "e_proj": nn.Linear(D, D, bias=False),
                                  "h_proj": nn.Linear(D, D, bias=False), "head": DeepseekV4HyperHead(self.hf.config)})
        nn.init.normal_(self.mtp["e_proj"].weight, std=cfg["initializer_range"])
        nn.init.normal_(self.mtp["h_proj"].weight, std=cfg["initializer_range"])
        head = self.mtp["head"]
        nn.init.normal_(head.hc_fn, std=cfg["initializer_range"])
        nn.init.zeros_(head.hc_base)
        nn.init.ones_(head.hc_scale)
        E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
        gen = torch.Generator().manual_seed(seed)
        self._routed: list[tuple[nn.Module, list[torch.Tensor]]] = []
        for name, mod in self.hf.named_modules():
            kind = type(mod).__name__
            if kind == "DeepseekV4HashRouter":  # transformers zero-fills the frozen token -> experts table
                mod.tid2eid.copy_(torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(cfg["vocab_size"])]))
            elif kind == "DeepseekV4TopKRouter":  # the chosen experts of the last forward (the bias update's load)
                seen: list[torch.Tensor] = []
                mod.register_forward_hook(lambda _m, _a, out, seen=seen: seen.append(out[2].detach()))
                self._routed.append((mod, seen))

    def _rope_and_mask(self, ids: torch.Tensor, emb: torch.Tensor):
        from transformers.masking_utils import create_sliding_window_causal_mask

        m = self.hf.model
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        mask = create_sliding_window_causal_mask(config=m.config, inputs_embeds=emb, attention_mask=None, cache=None,
                                                 position_ids=pos)
        rope = {t: m.rotary_emb(emb, position_ids=pos, layer_type=t) for t in ("main", "compress")}
        return pos, mask, rope

    def forward_logits(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T + 1] -> (main logits [B, T, V] at positions 0..T-1, MTP logits [B, T, V]: position i's
        draft of token i + 2 given token i + 1)."""
        m, L = self.hf.model, self.num_layers
        for _, seen in self._routed:  # (the routers' choices of this forward only: update_router_bias's load)
            seen.clear()
        ids = tokens[:, :-1]
        emb = m.embed_tokens(ids)
        pos, mask, rope = self._rope_and_mask(ids, emb)
        h = emb.unsqueeze(2).expand(-1, -1, m.config.hc_mult, -1).contiguous()
        kw = {"position_embeddings": rope, "position_ids": pos, "attention_mask": mask, "input_ids": ids, "cache": None}
        for layer in m.layers[:L]:
            h = layer(h, **kw)
        logits = self.hf.lm_head(m.norm(m.hc_head(h)))
        e = self.mtp["e_proj"](self.mtp["enorm"](m.embed_tokens(tokens[:, 1:])))
        x = self.mtp["h_proj"](self.mtp["hnorm"](h)) + e.unsqueeze(2)
        x = m.layers[L](x, **kw)
        return logits, self.hf.lm_head(self.mtp["norm"](self.mtp["head"](x)))

    def losses(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(next-token cross-entropy, the MTP module's next-next-token cross-entropy) over a window batch."""
        return cross_entropies(tokens, *self.forward_logits(tokens))

    @torch.no_grad()
    def update_router_bias(self, speed: float) -> None:
        """DeepSeek's auxiliary-loss-free balance: each top-k router's correction bias moves by `speed` towards its
        under-loaded experts (sign of mean load - load), from the last forward's choices."""
        E = self.cfg["n_routed_experts"]
        for router, seen in self._routed:
            if not seen:
                continue
            load = torch.bincount(torch.cat([s.reshape(-1) for s in seen]), minlength=E).float()
            router.e_score_correction_bias += speed * torch.sign(load.mean() - load)

    def deepseek_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor under DeepSeek's V4 names: transformers' own save (its names reversed to the checkpoint's
        by its conversion mapping) renamed from `model.*`, layer L as `mtp.0.*`, and the module's own tensors."""
        from safetensors.torch import load_file

        L = self.num_layers
        with tempfile.TemporaryDirectory() as d:
            self.hf.save_pretrained(d)
            saved: dict[str, torch.Tensor] = {}
            for name in sorted(os.listdir(d)):
                if name.endswith(".safetensors"):
                    saved.update(load_file(os.path.join(d, name)))
        out: dict[str, torch.Tensor] = {}
        for name, t in saved.items():
            if name.startswith(f"model.layers.{L}."):
                out["mtp.0." + name[len(f"model.layers.{L}."):]] = t
            elif name.startswith("model.layers."):
                out[name[len("model."):]] = t
            elif name.startswith("model.hc_head.hc_"):
                out["hc_head_" + name[len("model.hc_head.hc_"):]] = t
            else:
                out[{"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
                     "lm_head.weight": "head.weight"}.get(name, name)] = t
        for part in MTP_OWN:
            out[f"mtp.0.{part}.weight"] = self.mtp[part].weight
        for attr in ("fn", "base", "scale"):
            out[f"mtp.0.hc_head_{attr}"] = getattr(self.mtp["head"], f"hc_{attr}")
        # fp32 for the floating tensors; the hash layers' token -> experts table stays an integer table
        return {k: (v.detach().float() if v.is_floating_point() else v.detach()).contiguous() for k, v in out.items()}

    def export(self, out_dir: str, tokenizer_dir: str) -> None:
        """A deepinfer-loadable checkpoint: config.json, model.safetensors (fp32) and the tokenizer's files."""
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({**self.cfg, "torch_dtype": "float32"}, f, indent=1)
        save_file(self.deepseek_tensors(), os.path.join(out_dir, "model.safetensors"))
        for name in TOKENIZER_FILES:
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
