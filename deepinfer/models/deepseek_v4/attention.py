"""DeepSeek-V4 attention layer: projections, norms and RoPE around the backend's V4 attention op.

q:  x -> q_a_proj -> RMSNorm -> q_b_proj -> per-head unweighted RMSNorm -> RoPE
kv: x -> kv_proj -> RMSNorm -> RoPE (one head, used as both key and value)
The op returns per-head outputs whose rope slice carries the keys' rotation;
rotating it back by the query position (-sin) leaves only relative positions.
Output: heads split into o_groups, each projected by its own block of o_a_proj
(grouped low-rank projection), then o_b_proj mixes the groups.

Tensor parallelism (parallel.py says what is split and why): each rank holds H/tp heads, G/tp output
groups and their rows of wq_b / wo_a / columns of wo_b; the output is a partial sum all-reduced once
over "tp". The shared KV head, the compressors and the indexer are replicated.

Context-parallel prefill (a split step, cp_attention.py): the layer computes its rank's tokens, shares
their per-token KV inputs over "cp", replays the step's cache writes and attends for its own segments.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.backend import Backend, V4AttentionSpec
from deepinfer.backend.native.v4_rope import v4_cos_sin, v4_inv_freq
from deepinfer.models.deepseek_v4.config import CSA, DeepseekV4Config, RopeBranch
from deepinfer.models.deepseek_v4.cp_attention import context_parallel_v4
from deepinfer.models.deepseek_v4.parallel import head_shard
from deepinfer.models.layers.linear import Linear, Loader
from deepinfer.models.weights import sliced, tensor_loader

SWA_GROUP = "v4_swa"
COMP_GROUPS = {CSA: "v4_csa", "heavily_compressed_attention": "v4_hca"}
INDEX_GROUP = "v4_idx"


def inv_freq_of(branch: RopeBranch) -> torch.Tensor:
    return v4_inv_freq(branch.rope_dim, branch.theta, branch.rope_type, branch.factor,
                       branch.original_max_position_embeddings, branch.beta_fast, branch.beta_slow)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """x [T, G, in_g] with weight [G * out_g, in_g] viewed as G blocks -> [T, G * out_g]."""
    w = weight.view(groups, -1, x.shape[-1])  # [G, out_g, in_g]
    return torch.einsum("tgi,goi->tgo", x, w).reshape(x.shape[0], -1)


class RopeTable:
    """cos / sin of one rotary branch at given positions, rounded to the compute dtype like the reference."""

    def __init__(self, branch: RopeBranch, dtype: torch.dtype):
        self.inv_freq = inv_freq_of(branch)
        self.factor = branch.attention_factor
        self.dtype = dtype

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = v4_cos_sin(positions, self.inv_freq, self.factor)
        return cos.to(self.dtype), sin.to(self.dtype)


class V4Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_id: int, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.backend = backend
        self.comm = backend.communicator()  # "tp"
        self.shard = head_shard(cfg, self.comm)
        self.dtype = dtype
        self.layer_type = cfg.layer_types[layer_id]
        H, D, Dm, G = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size, cfg.o_groups
        self.H, self.D, self.G = self.shard.heads, D, self.shard.groups  # this rank's heads and groups
        q8 = cfg.quantization == "fp8_block"
        tp = self.comm
        self.q_a_proj = Linear(Dm, cfg.q_lora_rank, backend, dtype, quantized=q8)
        self.q_b_proj = Linear(cfg.q_lora_rank, H * D, backend, dtype, quantized=q8, split="column", tp=tp)
        self.kv_proj = Linear(Dm, D, backend, dtype, quantized=q8)
        self.o_a_proj = Linear(H * D // G, G * cfg.o_lora_rank, backend, dtype, quantized=q8, split="column", tp=tp)
        self.o_b_proj = Linear(G * cfg.o_lora_rank, Dm, backend, dtype, quantized=q8, split="row", tp=tp)
        self.o_a_weight: torch.Tensor | None = None  # o_a_proj dense, set by finalize
        self.q_a_norm: torch.Tensor | None = None
        self.kv_norm: torch.Tensor | None = None
        self.sinks: torch.Tensor | None = None
        self.m = cfg.compress_rate(layer_id)
        self.csa = self.layer_type == CSA
        # compressor / indexer projections stay unquantized in real V4 checkpoints (bf16)
        if self.m:
            width = (2 if self.csa else 1) * D
            self.c_kv = Linear(Dm, width, backend, dtype)
            self.c_gate = Linear(Dm, width, backend, dtype)
            self.c_bias: torch.Tensor | None = None
            self.c_norm: torch.Tensor | None = None
        if self.csa:
            Hi, Di = cfg.index_n_heads, cfg.index_head_dim
            self.i_kv = Linear(Dm, 2 * Di, backend, dtype)
            self.i_gate = Linear(Dm, 2 * Di, backend, dtype)
            self.i_q = Linear(cfg.q_lora_rank, Hi * Di, backend, dtype, quantized=q8)
            self.i_w = Linear(Dm, Hi, backend, dtype)
            self.i_bias: torch.Tensor | None = None
            self.i_norm: torch.Tensor | None = None
        self.rope_branch = cfg.rope_for(layer_id)
        self.rope = RopeTable(self.rope_branch, dtype)
        spec = V4AttentionSpec(
            num_heads=self.H, head_dim=D, sliding_window=cfg.sliding_window, softmax_scale=D**-0.5,
            swa_group=SWA_GROUP, compress_rate=self.m, overlap=self.csa,
            comp_group=COMP_GROUPS.get(self.layer_type), index_group=INDEX_GROUP if self.csa else None,
            index_n_heads=cfg.index_n_heads if self.csa else 0, index_head_dim=cfg.index_head_dim if self.csa else 0,
            index_topk=cfg.index_topk if self.csa else 0, norm_eps=cfg.rms_norm_eps,
            rope_attention_factor=self.rope_branch.attention_factor,
        )
        self.op = backend.make_v4_attention(spec)

    def loaders(self, p: str) -> dict[str, Loader]:
        cfg, dev, f32 = self.cfg, self.backend.device, torch.float32
        out: dict[str, Loader] = {}
        out.update(self.q_a_proj.loaders(f"{p}.wq_a"))
        out.update(self.q_b_proj.loaders(f"{p}.wq_b"))
        out.update(self.kv_proj.loaders(f"{p}.wkv"))
        out.update(self.o_a_proj.loaders(f"{p}.wo_a"))
        out.update(self.o_b_proj.loaders(f"{p}.wo_b"))
        out[f"{p}.q_norm.weight"] = tensor_loader(self, "q_a_norm", f"{p}.q_norm.weight", (cfg.q_lora_rank,), f32, dev)
        out[f"{p}.norm.weight"] = tensor_loader(self, "kv_norm", f"{p}.norm.weight", (self.D,), f32, dev)
        sinks = tensor_loader(self, "sinks", f"{p}.attn_sink", (self.H,), f32, dev)
        if self.shard.size > 1:  # this rank's heads' sinks
            sinks = sliced(sinks, 0, self.shard.first_head, self.shard.first_head + self.H)
        out[f"{p}.attn_sink"] = sinks
        if self.m:
            c = f"{p}.compressor"
            width = (2 if self.csa else 1) * self.D
            out.update(self.c_kv.loaders(f"{c}.wkv"))
            out.update(self.c_gate.loaders(f"{c}.wgate"))
            out[f"{c}.ape"] = tensor_loader(self, "c_bias", f"{c}.ape", (self.m, width), f32, dev)
            out[f"{c}.norm.weight"] = tensor_loader(self, "c_norm", f"{c}.norm.weight", (self.D,), f32, dev)
        if self.csa:
            i, Di = f"{p}.indexer", cfg.index_head_dim
            out.update(self.i_kv.loaders(f"{i}.compressor.wkv"))
            out.update(self.i_gate.loaders(f"{i}.compressor.wgate"))
            out.update(self.i_q.loaders(f"{i}.wq_b"))
            out.update(self.i_w.loaders(f"{i}.weights_proj"))
            out[f"{i}.compressor.ape"] = tensor_loader(self, "i_bias", f"{i}.compressor.ape", (self.m, 2 * Di), f32, dev)
            out[f"{i}.compressor.norm.weight"] = tensor_loader(self, "i_norm", f"{i}.compressor.norm.weight", (Di,), f32, dev)
        return out

    def finalize(self) -> None:
        for lin in self.linears():
            lin.finalize()
        self.o_a_weight = self.o_a_proj.dense()  # grouped_linear reads it dense every step: fetch it once
        w = {"sinks": self.sinks}
        if self.m:
            w.update({"rope_inv_freq": self.rope.inv_freq, "compressor.position_bias": self.c_bias,
                      "compressor.norm_weight": self.c_norm})
        if self.csa:
            w.update({"indexer.position_bias": self.i_bias, "indexer.norm_weight": self.i_norm})
        self.op.load_weights(w)

    def linears(self) -> list[Linear]:
        out = [self.q_a_proj, self.q_b_proj, self.kv_proj, self.o_a_proj, self.o_b_proj]
        if self.m:
            out += [self.c_kv, self.c_gate]
        if self.csa:
            out += [self.i_kv, self.i_gate, self.i_q, self.i_w]
        return out

    def forward(self, x: torch.Tensor, batch, caches, rope_memo: dict | None = None,
                state_snapshots=None, cp_step=None) -> torch.Tensor:
        """`rope_memo`: one forward's cos/sin per rotary branch, shared by the layers (else computed here).
        `state_snapshots`: prefix caching's ring snapshots for this step (kv/state_snapshots.py), handed to
        the op of a compressed layer; None when the step crosses no block boundary.
        `cp_step`: a split step of context-parallel prefill (cp_attention.V4SplitStep): this rank's tokens
        only; their KV inputs are shared with the other cp ranks (cp_attention.py)."""
        cfg, T = self.cfg, x.shape[0]
        eps = cfg.rms_norm_eps
        if rope_memo is None:
            cos, sin = self.rope(batch.positions)
        else:
            if self.rope_branch not in rope_memo:
                rope_memo[self.rope_branch] = self.rope(batch.positions)
            cos, sin = rope_memo[self.rope_branch]
        ops = self.backend
        q_res = ops.v4_rms_norm(self.q_a_proj(x), self.q_a_norm, eps)
        q = ops.v4_rms_norm(self.q_b_proj(q_res).view(T, self.H, self.D), None, eps)  # per head, unweighted
        q = ops.v4_rotary_embedding(q, cos, sin)
        kv = ops.v4_rotary_embedding(ops.v4_rms_norm(self.kv_proj(x), self.kv_norm, eps), cos, sin)
        extra = {}
        if self.m:
            extra.update(comp_kv=self.c_kv(x), comp_gate=self.c_gate(x))
            if state_snapshots is not None:
                extra["state_snapshots"] = state_snapshots
        if self.csa:
            Hi, Di = cfg.index_n_heads, cfg.index_head_dim
            iq = ops.v4_rotary_embedding(self.i_q(q_res).view(T, Hi, Di), cos, sin)
            extra.update(index_q=iq, index_weights=self.i_w(x).float() * Hi**-0.5, index_kv=self.i_kv(x),
                         index_gate=self.i_gate(x))
        if cp_step is not None:
            o = context_parallel_v4(self, q, kv, extra, caches, batch, cp_step)
        else:
            o = self.op.forward(q, kv, caches, self.layer_id, batch, **extra)
        o = ops.v4_rotary_embedding(o, cos, -sin)
        o = grouped_linear(o.reshape(T, self.G, -1), self.o_a_weight, self.G)
        return self.comm.all_reduce(self.o_b_proj(o))  # row-parallel output projection: partial sums over "tp"
