"""MoE for the CPU: small batches as two dense GEMMs over every expert, large ones by expert groups.

The native op (deepinfer.backend.native.moe, the reference the conformance suite checks this
against) loops over the experts that got tokens: per expert an index, two GEMMs, the SwiGLU, a
weighted scatter. On a CPU with a small model and a decode batch (16 tokens x top-2 over 16
experts: ~2 rows per expert) the loop's ~10 torch calls per expert cost far more than the
arithmetic. Below a work threshold this op instead runs every expert on every token:

  h   = x @ [gate_0 .. gate_{E-1}, gate_shared ; up_0 .. up_{E-1}, up_shared]^T   one GEMM [T, 2 (E + S) I]
  a   = silu(h_gate) * h_up                                                          [T, (E + S), I]
  a  *= c[t, e]       (c: the routing weight of expert e for token t, 0 if not chosen, 1 for shared)
  out = a @ [down_0 .. down_{E-1}, down_shared]^T                                    one GEMM [T, D]

which is the same sum (a token's unchosen experts contribute exact zeros) in about 12 calls
whatever the expert count; the shared experts (`fuse_shared_experts`) ride along as S more
experts of width I. The dense path does (E + S) / (k + S) times the routed arithmetic, so it runs
only while T * (E + S) * I * D stays under `dense_max_work` (DEEPINFER_CPU_MOE_DENSE_MAX_WORK;
that is where the measured loop overhead and the extra GEMM work break even on this machine's
shapes, docs/perf-log/2026-12-01-cpu-vs-vllm-cpu.md) and only for fp32 / bf16 (in fp16 an
unchosen expert's activation could overflow to inf and 0 * inf is NaN). Above it, the native
per-expert loop runs, with the shared experts called as the model gives them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from deepinfer.backend import INT4_ACT_ORDER, MOE_QUANT_SCHEMES, BackendError, MoESpec, NativeMoE, QuantizedExperts

DENSE_DTYPES = (torch.float32, torch.bfloat16)
PAIRS_MAX = 4  # at most this many (token, slot) pairs: one pair at a time on the expert weights in place


class CPUMoE(NativeMoE):
    def __init__(self, spec: MoESpec, route_fn, silu_and_mul: Callable, dense_max_work: int):
        super().__init__(spec, route_fn=route_fn)
        self.silu_and_mul = silu_and_mul
        self.dense_max_work = dense_max_work
        self.w13_all: torch.Tensor | None = None  # [2 (E + S) I, D]: every gate row, then every up row
        self.w2_all: torch.Tensor | None = None  # [D, (E + S) I]
        self.n_shared = 0
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().load_experts(w13, w2)
        self._build_dense()

    def quantized_expert_schemes(self) -> tuple[str, ...]:
        """Quantized experts run the native per-expert loop, each expert dequantized for its turn (the
        reference): memory stays quantized, no dense / pair fast path."""
        return (*MOE_QUANT_SCHEMES, INT4_ACT_ORDER)

    def load_quantized_experts(self, experts: QuantizedExperts) -> None:
        super().load_quantized_experts(experts)
        self._shared, self.n_shared = None, 0
        self._build_dense()  # drops any dense copies

    def replace_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().replace_experts(w13, w2)
        self._build_dense()  # the dense copies hold the old experts

    def fuse_shared_experts(self, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        i, d = self.spec.intermediate_size, self.spec.hidden_size
        if gate_up.dim() != 2 or gate_up.shape[1] != d or gate_up.shape[0] % (2 * i) or \
                tuple(down.shape) != (d, gate_up.shape[0] // 2):
            return False  # not S experts of width I: the model's shared MLP runs as given
        if self.w13 is None or gate_up.dtype != self.w13.dtype:
            return False
        self._shared = (gate_up.contiguous(), down.contiguous())
        self.n_shared = gate_up.shape[0] // (2 * i)
        self._build_dense()
        return True

    def _build_dense(self) -> None:
        e, i, d = self.spec.local_experts, self.spec.intermediate_size, self.spec.hidden_size
        n = e + (self._shared[0].shape[0] // (2 * i) if self._shared is not None else 0)
        if self.w13 is None or self.w13.dtype not in DENSE_DTYPES or n * i * d > self.dense_max_work:
            self.w13_all = self.w2_all = None  # never dense (not even one token): keep no second copy
            return
        gates, ups = [self.w13[:, :i].reshape(e * i, d)], [self.w13[:, i:].reshape(e * i, d)]
        downs = [self.w2.permute(1, 0, 2).reshape(d, e * i)]
        if self._shared is not None:
            gate_up, down = self._shared
            si = gate_up.shape[0] // 2
            gates.append(gate_up[:si])
            ups.append(gate_up[si:])
            downs.append(down)
        # stored transposed ([in, out] row-major) and used through the [out, in] view: F.linear then
        # runs MKL's NN GEMM, which streams a cache-cold weight faster here (ops_linear.py)
        self.w13_all = torch.cat(gates + ups).t().contiguous().t()
        self.w2_all = torch.cat(downs, dim=1).t().contiguous().t()

    def dense_ok(self, x: torch.Tensor) -> bool:
        if self.w13_all is None or x.dtype != self.w13_all.dtype:
            return False
        e = self.spec.local_experts + self.n_shared
        return x.shape[0] * e * self.spec.intermediate_size * self.spec.hidden_size <= self.dense_max_work

    def experts_dense(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      with_shared: bool) -> torch.Tensor:
        """Routed (+ shared, when with_shared) experts for every token at once; [T, D] in x's dtype."""
        t = x.shape[0]
        e, i = self.spec.local_experts, self.spec.intermediate_size
        n = e + self.n_shared
        coef = torch.zeros((t, n), dtype=torch.float32, device=x.device)
        mine = topk_ids >= 0  # a -1 pair (another rank's expert) adds an exact 0.0 to expert 0's coefficient
        coef.scatter_add_(1, topk_ids.clamp(min=0), torch.where(mine, topk_weights.float(), 0.0))
        # a token routed twice to e (hash) sums, as native
        if self.n_shared:
            coef[:, e:] = 1.0 if with_shared else 0.0
        h = F.linear(x, self.w13_all)  # [T, 2 n I]
        a = self.silu_and_mul(h, self.spec.swiglu_limit).view(t, n, i)
        a = (a * coef.to(a.dtype).unsqueeze(-1)).view(t, n * i)
        return F.linear(a, self.w2_all)

    def experts_pairs(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      with_shared: bool) -> torch.Tensor:
        """Routed (+ shared) experts pair by pair on the expert weights in place (no gather, no copy):
        for a handful of (token, slot) pairs this reads k experts' weights instead of all of them."""
        t, k = topk_ids.shape
        ids, ws = topk_ids.tolist(), topk_weights.float().tolist()
        limit = self.spec.swiglu_limit
        rows = []
        for r in range(t):
            xr = x[r : r + 1]
            acc = None
            for j in range(k):  # slot order, each product in fp32, as the native combine
                e = ids[r][j]
                if e < 0:  # another rank's expert (expert parallelism)
                    continue
                y = F.linear(self.silu_and_mul(F.linear(xr, self.w13[e]), limit), self.w2[e]).float() * ws[r][j]
                acc = y if acc is None else acc + y
            rows.append(acc if acc is not None else x.new_zeros((1, x.shape[1]), dtype=torch.float32))
        out = (rows[0] if t == 1 else torch.cat(rows)).to(x.dtype) if t else x.new_zeros((0, x.shape[1]))
        if with_shared:
            gate_up, down = self._shared
            out = out + F.linear(self.silu_and_mul(F.linear(x, gate_up)), down)
        return out

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts alone (expert parallelism: -1 ids add nothing), by the same size rule as forward."""
        if self.quant is not None:
            return super().experts(x, topk_weights, topk_ids)
        if self.w13 is None or self.w2 is None:
            raise BackendError("MoE experts before load_experts")
        if topk_ids.numel() <= PAIRS_MAX:
            return self.experts_pairs(x, topk_weights, topk_ids, with_shared=False)
        if self.dense_ok(x):
            return self.experts_dense(x, topk_weights, topk_ids, with_shared=False)
        return super().experts(x, topk_weights, topk_ids)

    def forward(self, x, router_logits, correction_bias=None, token_ids=None, tid2eid=None, shared_experts=None):
        if self.quant is not None:
            return NativeMoE.forward(self, x, router_logits, correction_bias, token_ids, tid2eid, shared_experts)
        if self.w13 is None or self.w2 is None:
            raise BackendError("MoE forward before load_experts")
        weights, ids = self.route_fn(router_logits, self.spec.router, correction_bias, token_ids, tid2eid)
        if ids.numel() <= PAIRS_MAX:
            fused = shared_experts is not None and self._shared is not None
            out = self.experts_pairs(x, weights, ids, with_shared=fused)
            if shared_experts is not None and not fused:
                out = out + shared_experts(x)
            return out
        if self.dense_ok(x):
            fused = shared_experts is not None and self.n_shared > 0
            out = self.experts_dense(x, weights, ids, with_shared=fused)
            if shared_experts is not None and not fused:
                out = out + shared_experts(x)
            return out
        out = super().experts(x, weights, ids)
        if shared_experts is not None:
            out = out + shared_experts(x)
        return out
