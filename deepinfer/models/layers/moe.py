"""A DeepSeek V2/V3 MoE layer: fp32 router gate, routed + shared experts (a dense MLP) through the backend MoE op.

The per-expert checkpoint tensors (`experts.E.{gate,up,down}_proj`) are held
and stacked by `ExpertWeights`.

Many ranks (docs/parallelism.md), three modes, fixed at construction from the backend's communicators:
- one rank: the op's whole-layer forward, as it always was (no extra op on this path);
- tensor parallel ("tp" > 1, "ep" of one): every rank holds each expert's slice of the intermediate dimension
  and routes every token (replicated gate); routed + shared (the shared MLP is column / row split too) are a
  partial sum, reduced once over "tp";
- expert parallel ("ep" > 1): whole experts per rank, as an `ExpertPlacement` says (redundant replicas when the
  load balancer adds them). Two ways to move the tokens (`ep_dispatch`, EngineConfig.ep_dispatch; "auto" picks
  by the forward's token count over every replica):
  - all-gather: every rank routes every token over all logical experts, maps each (token, slot) to
    one replica (by token and slot index, the same on every rank) and so to a local slot or -1, runs its local
    experts, adds the shared experts' tp-partial into its own replica's rows and all-reduces over "ep". With
    data-parallel attention ("dp" > 1) the hidden states are all-gathered over "dp" first (padded to the largest
    replica's token count) and each rank keeps its replica's rows; a replica with no tokens still takes part;
  - all-to-all (ep_all_to_all.py): each rank routes its share of its replica's tokens and sends each pair to the
    rank of its slot, which returns the expert output; the source combines in slot order.
  A replica's dummy forward (`idle_replica`) takes part with zero tokens either way.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.backend import Backend, Fp8Act, MoESpec
from deepinfer.errors import ConfigError
from deepinfer.models.deepseek_v3.config import DeepseekConfig
from deepinfer.models.layers.ep_all_to_all import (
    EPDispatch,
    choose_path,
    combine_share,
    dispatch_experts,
    token_share,
)
from deepinfer.models.layers.experts import ExpertPlacement, ExpertWeights
from deepinfer.models.layers.linear import Loader
from deepinfer.models.layers.mlp import GatedMLP
from deepinfer.models.layers.moe_dispatch import (
    ExpertParallelRouting,
    gather_replicas,
    install_placement,
    load_routed_experts,
    make_moe_op,
)
from deepinfer.models.layers.quant.shared_experts import shared_as_quantized_experts
from deepinfer.models.weights import tensor_loader

_PROJS = ("gate_proj", "up_proj", "down_proj")


class MoELayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.backend = backend
        self.num_experts = cfg.n_routed_experts
        self.hidden_size = D = cfg.hidden_size
        inter = cfg.moe_intermediate_size
        quantized = cfg.quantization == "fp8_block"
        self.router = cfg.router_spec()
        self.use_bias = cfg.topk_method == "noaux_tc"
        self.gate_weight: torch.Tensor | None = None  # [E, D] fp32, as the reference keeps it
        self.e_score_correction_bias: torch.Tensor | None = None  # [E] fp32, selection only
        tp, self.ep, self.dp = backend.communicator("tp"), backend.communicator("ep"), backend.communicator("dp")
        self.tp = tp
        self.expert_parallel = self.ep.world_size > 1
        self.ep_dispatch = EPDispatch()  # the engine sets EngineConfig.ep_dispatch (ep_all_to_all.set_ep_dispatch)
        self.idle_replica = False  # True during a data-parallel replica's dummy forward (IdleReplicaForward)
        self.dispatch_counts: dict[str, int] = {}  # forwards per path ("all_to_all" / "all_gather")
        self.placement: ExpertPlacement | None = None
        self.routing: ExpertParallelRouting | None = None
        local, tp_part, num_local = inter, None, None
        if self.expert_parallel:
            self.placement = ExpertPlacement.contiguous(self.num_experts, self.ep.world_size)
            num_local = self.placement.slots_per_rank
        elif tp.world_size > 1:
            if inter % tp.world_size:
                raise ConfigError(f"moe_intermediate_size {inter} does not split evenly over tensor_parallel_size "
                                  f"{tp.world_size} (routed experts are split like a dense MLP without "
                                  "enable_expert_parallel)")
            local = inter // tp.world_size
            tp_part = (tp.rank, tp.world_size)
        self.experts = ExpertWeights(
            cfg.n_routed_experts, D, local, backend, dtype, quantized, _PROJS,
            slot_experts=self.placement.rank_experts(self.ep.rank) if self.placement else None, tp_part=tp_part)
        self.shared_experts = (
            GatedMLP(D, inter * cfg.n_shared_experts, backend, dtype, quantized=quantized, reduce_output=False)
            if cfg.n_shared_experts
            else None
        )
        self.comm = self.ep if self.expert_parallel else tp  # routed + shared partial sums: one reduce
        self.spec = MoESpec(router=self.router, hidden_size=D, intermediate_size=local, num_local_experts=num_local)
        self.op = make_moe_op(backend, self.spec, self.expert_parallel)
        # expert parallelism: the stacked local weights the op was given (the load balancer moves them)
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        # tokens routed to each logical expert, counted here when the load balancer asks (parallel/eplb.py)
        self.expert_load: torch.Tensor | None = None
        self.quantized_experts = False  # set at finalize: the op kept the checkpoint's quantized experts

    def loaders(self, prefix: str) -> dict[str, Loader]:
        dev = self.backend.device
        name = f"{prefix}.gate.weight"
        out = {name: tensor_loader(self, "gate_weight", name, (self.num_experts, self.hidden_size), torch.float32, dev)}
        if self.use_bias:
            name = f"{prefix}.gate.e_score_correction_bias"
            out[name] = tensor_loader(self, "e_score_correction_bias", name, (self.num_experts,), torch.float32, dev)
        out.update(self.experts.loaders(prefix))
        if self.shared_experts is not None:
            out.update(self.shared_experts.loaders(f"{prefix}.shared_experts"))
        return out

    def finalize(self) -> None:
        scheme, group = self.experts.scheme, self.experts.group_size
        load_routed_experts(self)  # quantized kept or densified; the expert-parallel routing (moe_dispatch.py)
        if self.shared_experts is not None:
            folded = False
            if self.quantized_experts and not self.expert_parallel and self.tp.world_size == 1:
                # the shared MLP as extra experts in the kept scheme, read before its linears take the weights
                shared = shared_as_quantized_experts(self.shared_experts, scheme, self.spec.intermediate_size, group)
                self.shared_experts.finalize()
                folded = shared is not None and self.op.fuse_shared_quantized(shared)
            else:
                self.shared_experts.finalize()
            if not self.expert_parallel and not folded:
                # the op may run the shared MLP as extra experts at small batches; it still calls the
                # module (one dense GEMM per weight) where it does not
                self.op.fuse_shared_experts(*self.shared_experts.dense_weights())

    def install_placement(self, placement: ExpertPlacement, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Between steps (the load balancer): a new placement and this rank's weights (moe_dispatch.py)."""
        install_placement(self, placement, w13, w2)

    def takes_fp8_act(self, num_tokens: int) -> bool:
        """Whether forward takes its input as Fp8Act at this token count: the op's W8A8 routed experts read it
        (the shared MLP's linears then read the same quantization: one act quant for both). One rank's path or
        tensor parallelism only; expert parallelism moves plain hidden states."""
        return not self.expert_parallel and self.op.takes_fp8_act(num_tokens)

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        if not self.expert_parallel:
            # fp32 router gate as the reference; the op may fuse it with the top-k
            out = self.op.forward_hidden(x, self.gate_weight, self.e_score_correction_bias, self.shared_experts)
            return self.comm.all_reduce(out)  # routed + shared: partial sums under tensor parallelism
        return self._forward_expert_parallel(x)

    def _forward_expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        if self.idle_replica:  # the dummy forward: join the collectives with no tokens (ep_all_to_all.py)
            self._dispatch(x[:0])
            return torch.zeros_like(x)
        return self._dispatch(x)

    def _dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """The all-to-all or the all-gather path, as self.ep_dispatch picks for this forward's token count."""
        use_all_to_all, counts = choose_path(self, x)
        if use_all_to_all:
            share = token_share(x.shape[0], self.tp)
            xs = x[share]
            weights, ids = self.op.route(self.op.router_logits(xs, self.gate_weight), self.e_score_correction_bias)
            routed = dispatch_experts(xs, weights, ids, self.routing, self.ep, self.op, self.expert_load)
            return combine_share(x, routed, share, self.shared_experts, self.tp)
        xs, own = gather_replicas(x, self.dp, counts)  # every replica's tokens; own: this replica's rows of them
        weights, ids = self.op.route(self.op.router_logits(xs, self.gate_weight), self.e_score_correction_bias)
        local = self.routing.local_ids(ids)
        if self.expert_load is not None:
            self.routing.count(self.expert_load, ids, local)
        out = self.op.experts(xs, weights, local)
        if self.shared_experts is not None:
            out[own] = out[own] + self.shared_experts(x)
        if out.shape[0]:  # every rank has the same row count (gathered): all skip together at zero tokens
            out = self.comm.all_reduce(out)
        return out[own]
