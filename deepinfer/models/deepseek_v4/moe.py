"""DeepSeek-V4 MoE block: routed experts (backend MoE op) + one shared expert, both SwiGLU-clamped.

Routing: scores = sqrt(softplus(logits)) (or the configured scoring_func);
`moe` layers select the top-k of scores + e_score_correction_bias (bias for
selection only), `hash_moe` layers take the experts from the frozen
tid2eid[token_id] table. The weights are the unbiased scores of the chosen
experts, normalised to sum 1 (always, as the reference does), times
routed_scaling_factor. Checkpoint names follow DeepSeek's release:
experts.E.w1 (gate), w3 (up), w2 (down).

Many ranks, the three modes of the V2/V3 MoE layer (models/layers/moe.py, whose placement, id mapping and
data-parallel gather this reuses from layers/experts.py and layers/moe_dispatch.py):
- one rank: the op's whole-layer forward;
- tensor parallel ("ep" of one): each expert's intermediate dimension split over "tp" (the clamp and
  SwiGLU act elementwise on it, so the split is exact), the shared expert column / row split too; routed +
  shared are a partial sum, reduced once over "tp";
- expert parallel ("ep" > 1): whole experts per rank as an `ExpertPlacement` says; every rank routes every
  token (hash layers: the token ids are gathered over "dp" with the hidden states), runs its local experts
  for every (token, slot) pair mapped to it, adds the shared expert's tp-partial into its own replica's rows
  and all-reduces over "ep" (the all-gather path), or each rank sends its share of its replica's pairs, hash
  layers' token ids local, to the ranks of their slots (the all-to-all path, layers/ep_all_to_all.py; chosen by
  `ep_dispatch`, as in the V2/V3 layer). The load balancer (parallel/eplb.py) counts and moves these layers' experts
  as the V2/V3 ones (`expert_parallel`, `placement`, `expert_load`, `w13` / `w2`, `install_placement`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.backend import Backend, MoESpec, RouterSpec
from deepinfer.errors import ConfigError, ModelLoadError
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
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
from deepinfer.models.weights import tensor_loader


class V4MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_id: int, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.backend = backend
        self.is_hash = cfg.mlp_layer_types[layer_id] == "hash_moe"
        E, D, inter, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        self.E, self.D, self.k, self.vocab = E, D, k, cfg.vocab_size
        self.num_experts, self.hidden_size = E, D  # the names the load balancer reads
        q8 = cfg.quantization == "fp8_block"
        self.router = RouterSpec(
            num_experts=E, top_k=k, scoring_func=cfg.scoring_func, topk_method="hash" if self.is_hash else "noaux_tc",
            n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=cfg.routed_scaling_factor,
        )
        self.gate_weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.tid2eid: torch.Tensor | None = None
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
            self.placement = ExpertPlacement.contiguous(E, self.ep.world_size)
            num_local = self.placement.slots_per_rank
        elif tp.world_size > 1:
            if inter % tp.world_size:
                raise ConfigError(f"moe_intermediate_size {inter} does not split evenly over tensor_parallel_size "
                                  f"{tp.world_size} (routed experts are split like a dense MLP without "
                                  "enable_expert_parallel)")
            local, tp_part = inter // tp.world_size, (tp.rank, tp.world_size)
        self.experts = ExpertWeights(  # fp4: V4's e2m1 routed experts (the shared expert stays fp8)
            E, D, local, backend, dtype, q8, ("w1", "w3", "w2"),
            slot_experts=self.placement.rank_experts(self.ep.rank) if self.placement else None, tp_part=tp_part,
            fp4=cfg.expert_dtype == "fp4")
        self.shared = GatedMLP(D, inter, backend, dtype, quantized=q8, swiglu_limit=cfg.swiglu_limit,
                               names=("w1", "w3", "w2"), reduce_output=False)
        self.comm = self.ep if self.expert_parallel else tp  # routed + shared partial sums: one reduce
        self.swiglu_limit = cfg.swiglu_limit
        self.spec = MoESpec(router=self.router, hidden_size=D, intermediate_size=local,
                            swiglu_limit=cfg.swiglu_limit, num_local_experts=num_local)
        self.op = make_moe_op(backend, self.spec, self.expert_parallel)
        # expert parallelism: the stacked local weights the op was given (the load balancer moves them), and
        # the per-logical-expert pair counter it turns on
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.expert_load: torch.Tensor | None = None
        self.quantized_experts = False  # set at finalize

    def _set_tid2eid(self, name: str):
        def load(t: torch.Tensor) -> None:
            if tuple(t.shape) != (self.vocab, self.k):
                raise ModelLoadError(f"{name} has shape {tuple(t.shape)}, expected {(self.vocab, self.k)}")
            if t.is_floating_point() or t.is_complex():
                raise ModelLoadError(f"{name} has dtype {t.dtype}; expected an integer table")
            if int(t.min()) < 0 or int(t.max()) >= self.E:
                raise ModelLoadError(f"{name} holds expert ids outside [0, {self.E})")
            self.tid2eid = t.to(device=self.backend.device, dtype=torch.long)
        return load

    def loaders(self, p: str) -> dict[str, Loader]:
        dev, f32 = self.backend.device, torch.float32
        out = {f"{p}.gate.weight": tensor_loader(self, "gate_weight", f"{p}.gate.weight", (self.E, self.D), f32, dev)}
        if self.is_hash:
            out[f"{p}.gate.tid2eid"] = self._set_tid2eid(f"{p}.gate.tid2eid")
        else:
            out[f"{p}.gate.bias"] = tensor_loader(self, "bias", f"{p}.gate.bias", (self.E,), f32, dev)
        out.update(self.experts.loaders(p))
        out.update(self.shared.loaders(f"{p}.shared_experts"))
        return out

    def finalize(self) -> None:
        load_routed_experts(self)  # quantized (fp8 / fp4) kept or densified, as in the V2/V3 layer (moe_dispatch.py)
        self.shared.finalize()

    def install_placement(self, placement: ExpertPlacement, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Between steps (the load balancer): a new placement and this rank's weights (moe_dispatch.py)."""
        install_placement(self, placement, w13, w2)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel:
            return self._forward_expert_parallel(x, token_ids)
        logits = F.linear(x.float(), self.gate_weight)
        if self.is_hash:
            routed = self.op.forward(x, logits, token_ids=token_ids, tid2eid=self.tid2eid)
        else:
            routed = self.op.forward(x, logits, correction_bias=self.bias)
        return self.comm.all_reduce(routed + self.shared(x))  # partial sums under tensor parallelism

    def _route(self, xs: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(xs.float(), self.gate_weight)
        if self.is_hash:
            return self.op.route(logits, token_ids=token_ids, tid2eid=self.tid2eid)
        return self.op.route(logits, correction_bias=self.bias)

    def _forward_expert_parallel(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        if self.idle_replica:  # the dummy forward: join the collectives with no tokens (ep_all_to_all.py)
            self._dispatch(x[:0], token_ids.reshape(-1)[:0])
            return torch.zeros_like(x)
        return self._dispatch(x, token_ids.reshape(-1))

    def _dispatch(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The all-to-all or the all-gather path, as self.ep_dispatch picks for this forward's token count."""
        use_all_to_all, counts = choose_path(self, x)
        if use_all_to_all:
            share = token_share(x.shape[0], self.tp)
            weights, ids = self._route(x[share], token_ids[share])
            routed = dispatch_experts(x[share], weights, ids, self.routing, self.ep, self.op, self.expert_load)
            return combine_share(x, routed, share, self.shared, self.tp)
        xs, own = gather_replicas(x, self.dp, counts)  # every replica's tokens; own: this replica's rows of them
        # hash layers: the table is indexed by token id, so the ids are gathered the same way
        ids_all = gather_replicas(token_ids.reshape(-1, 1), self.dp, counts)[0].reshape(-1) if self.is_hash else None
        weights, ids = self._route(xs, ids_all)
        local = self.routing.local_ids(ids)
        if self.expert_load is not None:
            self.routing.count(self.expert_load, ids, local)
        out = self.op.experts(xs, weights, local)
        out[own] = out[own] + self.shared(x)  # the shared expert's tp-partial, on this replica's rows only
        if out.shape[0]:  # every rank has the same row count (gathered): all skip together at zero tokens
            out = self.comm.all_reduce(out)
        return out[own]
