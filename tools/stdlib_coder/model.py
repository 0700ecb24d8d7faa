"""The training-time DeepSeek-V3 (+ one MTP module), in plain differentiable PyTorch.

Why a second implementation: the engine's model runs over a paged KV cache through backend ops and is not
meant for autograd. This one is written from the DeepSeek-V3 report and Hugging Face's `deepseek_v3`
module, tensor for tensor, under the same parameter names, so `export.py` writes a checkpoint that both
transformers and DeepInfer load; tests/models/test_stdlib_coder_*.py check it against transformers.

The pieces the report describes and inference never sees live here only:
- routing keeps the sigmoid affinities for the gate values and adds the correction bias only for the
  choice; the bias is not trained by gradients but nudged after each step (auxiliary-loss-free balancing,
  `update_router_bias`), with a tiny sequence-wise balance loss beside it;
- the MTP module predicts token i+2 from the main model's final hidden state at i and the embedding of
  token i+1 (embedding first, then hidden, in `eh_proj`'s input, as vLLM and SGLang read DeepSeek's
  released weights), through one more decoder layer, the shared output head and its own norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.backend.native.rope import mla_softmax_scale, rope_cos_sin_cache


@dataclass(frozen=True)
class V3Shape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    num_nextn_predict_layers: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "V3Shape":
        if cfg.get("model_type") != "deepseek_v3" or cfg.get("topk_method") != "noaux_tc":
            raise ValueError("the trainer builds model_type deepseek_v3 with noaux_tc routing only")
        if not cfg.get("rope_interleave", True):
            raise ValueError("the trainer rotates interleaved rope pairs (rope_interleave true), as V3 does")
        return cls(**{f: cfg[f] for f in cls.__dataclass_fields__})

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, R]: pairs (2i, 2i+1) rotated by frequency i; cos/sin [S, R/2] fp32."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2).to(x.dtype)


class MLA(nn.Module):
    def __init__(self, c: V3Shape):
        super().__init__()
        self.c = c
        H = c.num_attention_heads
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * c.v_head_dim, c.hidden_size, bias=False)
        self.scale = mla_softmax_scale(c.qk_head_dim, c.rope_scaling)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, (B, S, _) = self.c, x.shape
        H = c.num_attention_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, S, H, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, S, H, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        q_pe = rotate_interleaved(q_pe, cos, sin)
        k_pe = rotate_interleaved(k_pe[:, :, None, :], cos, sin).expand(B, S, H, c.qk_rope_head_dim)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, H * c.v_head_dim))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Sigmoid noaux_tc routing (group-limited, correction bias for the choice only) over routed experts kept
    as stacked weights [E, out, in], plus the shared experts. Every expert is computed for every token and
    the unselected ones get weight 0: the same function as a sparse dispatch, in a few big matmuls, which
    is the fast way at this size."""

    def __init__(self, c: V3Shape):
        super().__init__()
        self.c = c
        E, D, I = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.gate_weight = nn.Parameter(torch.empty(E, D))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.w_gate = nn.Parameter(torch.empty(E, I, D))
        self.w_up = nn.Parameter(torch.empty(E, I, D))
        self.w_down = nn.Parameter(torch.empty(E, D, I))
        self.shared_experts = GatedMLP(D, I * c.n_shared_experts)
        self.last_load: torch.Tensor | None = None  # tokens per expert in the last forward (for the bias update)
        self.last_balance_loss: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (scores [N, E] fp32, top-k ids [N, K], gate values [N, K] fp32)."""
        c = self.c
        N, E, G = x.shape[0], c.n_routed_experts, c.n_group
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = torch.sigmoid(x.float() @ self.gate_weight.float().t())
        choice = scores.detach() + self.e_score_correction_bias
        group_scores = choice.view(N, G, E // G).topk(2, dim=-1).values.sum(-1)
        group_idx = group_scores.topk(c.topk_group, dim=-1).indices
        group_mask = torch.zeros(N, G, device=x.device, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask[:, :, None].expand(N, G, E // G).reshape(N, E)
        topk_idx = choice.masked_fill(~expert_mask, float("-inf")).topk(c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, topk_idx)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return scores, topk_idx, w * c.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, (B, S, D) = self.c, x.shape
        flat = x.reshape(B * S, D)
        scores, topk_idx, w = self.route(flat)
        E, K = c.n_routed_experts, c.num_experts_per_tok
        combine = torch.zeros(B * S, E, device=x.device, dtype=torch.float32).scatter(1, topk_idx, w)
        if self.training:
            with torch.no_grad():
                self.last_load = torch.bincount(topk_idx.flatten(), minlength=E).float()
            # sequence-wise balance loss (DeepSeek-V3 report, eq. 17-20): per sequence, f_i * P_i summed
            chosen = torch.zeros_like(scores).scatter(1, topk_idx, 1.0).view(B, S, E)
            f = chosen.mean(1) * (E / K)
            p = (scores / scores.sum(-1, keepdim=True)).view(B, S, E).mean(1)
            self.last_balance_loss = (f * p).sum(-1).mean()
        h = torch.einsum("nd,eid->eni", flat, self.w_gate)
        u = torch.einsum("nd,eid->eni", flat, self.w_up)
        y = torch.einsum("eni,edi->end", F.silu(h) * u, self.w_down)
        routed = torch.einsum("end,ne->nd", y, combine.to(y.dtype))
        return (routed + self.shared_experts(flat)).view(B, S, D)


class DecoderLayer(nn.Module):
    def __init__(self, c: V3Shape, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLA(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp: nn.Module = MoE(c) if layer_id >= c.first_k_dense_replace else GatedMLP(
            c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPModule(nn.Module):
    """DeepSeek-V3's multi-token prediction module (depth 1), under the released checkpoints' names."""

    def __init__(self, c: V3Shape, layer_id: int):
        super().__init__()
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.block = DecoderLayer(c, layer_id)
        self.shared_head_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head_norm(self.block(x, cos, sin))


class TrainingV3(nn.Module):
    def __init__(self, c: V3Shape, init_std: float = 0.02):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(c, c.num_hidden_layers + k) for k in range(c.num_nextn_predict_layers))
        self.register_buffer("rope_cache", rope_cos_sin_cache(
            c.qk_rope_head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling), persistent=False)
        self.reset_parameters(init_std)

    def reset_parameters(self, std: float) -> None:
        depth_scale = (2 * (self.c.num_hidden_layers + len(self.mtp))) ** -0.5
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)  # norms
            elif name.endswith(("o_proj.weight", "down_proj.weight", "w_down")):
                nn.init.normal_(p, std=std * depth_scale)  # residual-branch outputs (GPT-2 style)
            else:
                nn.init.normal_(p, std=std)

    def cos_sin(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.rope_cache[:seq_len]
        half = cs.shape[-1] // 2
        return cs[:, :half], cs[:, half:]

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Final (normed) hidden states [B, S, D] for ids [B, S]."""
        cos, sin = self.cos_sin(ids.shape[1])
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: torch.Tensor, k: int = 0) -> torch.Tensor:
        """MTP depth k+1: hidden[:, i] (position i) with token i+1 -> the state that predicts token i+2."""
        cos, sin = self.cos_sin(next_ids.shape[1])
        return self.mtp[k](hidden, self.embed_tokens(next_ids), cos, sin)

    def moe_layers(self) -> list[MoE]:
        mods = [layer.mlp for layer in self.layers] + [m.block.mlp for m in self.mtp]
        return [m for m in mods if isinstance(m, MoE)]

    def losses(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """tokens [B, S+1] -> (main next-token CE, MTP next-next-token CE or None, balance loss)."""
        ids, targets = tokens[:, :-1], tokens[:, 1:]
        h = self.hidden(ids)
        main = F.cross_entropy(self.lm_head(h).float().flatten(0, 1), targets.flatten())
        mtp = None
        if len(self.mtp):
            hm = self.mtp_hidden(h[:, :-1], ids[:, 1:])
            mtp = F.cross_entropy(self.lm_head(hm).float().flatten(0, 1), targets[:, 1:].flatten())
        bal = sum((m.last_balance_loss for m in self.moe_layers() if m.last_balance_loss is not None),
                  torch.zeros((), device=tokens.device))
        return main, mtp, bal

    @torch.no_grad()
    def update_router_bias(self, speed: float) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
        for m in self.moe_layers():
            if m.last_load is not None:
                m.e_score_correction_bias += speed * torch.sign(m.last_load.mean() - m.last_load)
