"""Kernel microbenchmarks on the GPU at DeepSeek-V2-Lite shapes (JSON lines + a table).

- MLA decode: effective bandwidth (latent cache bytes read / time) at batch 64,
  4k context, for a few tile / split choices; target >= 2.5 TB/s.
- the whole MoE layer (router + routed + shared experts) at 1..256 tokens through
  CUDA-graph replay: the pre-fusion schedule ("old_ms") vs TritonMoE's (direct
  mode with the shared experts folded in at small batches, fused SiLU and
  combine), as weight bandwidth; plus MoE tile sweeps (env overrides).
- routing and block alignment: Triton / torch vs the CUDA C++ kernels, to pick
  the faster one as the default.
- a device-to-device copy, the bandwidth ceiling, measured in the same run.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
import triton

from benchmarks.graph_timing import graph_ms as timed_by_graph
from deepinfer.backend import RouterSpec

ROWS: list[dict] = []
DEV = "cuda"  # the MoE benchmarks' device (a CPU dry run under TRITON_INTERPRET sets "cpu")


def bench(fn, reps: int = 50) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median")  # ms


def emit(**row) -> None:
    row["bench"] = "kernel"
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    tbs = 2 * x.numel() / ms / 1e9
    emit(name="d2d copy", ms=ms, TBps=tbs)
    return tbs


def mla_decode_bench(batch: int = 64, ctx: int = 4096, heads: int = 16, page: int = 64) -> None:
    from deepinfer.backends.nvidia.mla_decode import default_num_splits, mla_decode

    L, R = 512, 64
    blocks_per_seq = ctx // page
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(num_blocks, page, L + R, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, L + R, device="cuda", dtype=torch.bfloat16)
    nbytes = batch * ctx * (L + R) * 2
    # correctness at this shape against a torch reference, one sequence
    out = mla_decode(q, cache, table, seq, L, 0.1)
    kv = cache[table[0].long()].reshape(-1, L + R).float()
    ref = ((q[0].float() @ kv.T) * 0.1).softmax(-1) @ kv[:, :L]
    err = float((out[0].float() - ref).norm() / ref.norm())
    for block_n, warps, stages in ((32, 4, 2), (32, 4, 3), (64, 8, 2)):
        for splits in (None, 8, 12):
            s = splits or default_num_splits(batch, heads)
            try:
                ms = bench(lambda: mla_decode(q, cache, table, seq, L, 0.1, num_splits=s, block_n=block_n,
                                              num_warps=warps, num_stages=stages))
            except Exception as exc:  # an out-of-resources tile choice is a result, not a crash
                emit(name="mla_decode", batch=batch, ctx=ctx, block_n=block_n, warps=warps, stages=stages,
                     splits=s, error=str(exc)[:200])
                continue
            emit(name="mla_decode", batch=batch, ctx=ctx, block_n=block_n, warps=warps, stages=stages, splits=s,
                 ms=ms, TBps=nbytes / ms / 1e9, rel_err=err)


def graph_ms(fn, inner: int = 1, reps: int = 20) -> float:
    """ms per fn() call through CUDA-graph replay (benchmarks/graph_timing.py); a CPU dry run just calls fn."""
    return timed_by_graph(fn, inner, reps, dry_run=DEV != "cuda", dry_value=1.0)


class MoEBench:
    """V2-Lite MoE layers (64 experts top-6, 2 shared, 2048 x 1408, bf16), one weight set per layer so a
    graph of LAYERS layers streams weights like a decode step (no L2 reuse between layers)."""

    E, D, I, K, SHARED, LAYERS = 64, 2048, 1408, 6, 2, 3

    def __init__(self, device: str | None = None):
        from deepinfer.backends.nvidia import cuda_ext
        from deepinfer.backends.nvidia.moe_routing import moe_align, route

        device = device or DEV
        E, D, I, S = self.E, self.D, self.I, self.SHARED
        self.spec = RouterSpec(E, self.K, "softmax", "greedy")
        try:
            if device != "cuda":
                raise RuntimeError("no CUDA C++ kernels off the GPU")
            ext = cuda_ext.load()
            self.route = lambda logits: cuda_ext.grouped_topk(ext, logits, self.spec, None)
            self.align = cuda_ext.make_align(ext)
        except Exception:  # no nvcc: the Triton / torch twins
            self.route = lambda logits: route(logits, self.spec)
            self.align = moe_align
        from deepinfer.backends.nvidia.fused_moe import counters_for

        self.counters = counters_for(D, device)  # the fused combine's (self-resetting) column counters
        self.route_counters = torch.zeros(64, dtype=torch.int32, device=device)  # the fused router's
        mk = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02  # noqa: E731
        self.layers = [dict(gate=torch.randn(E, D, device=device) * 0.02, w13=mk(E, 2 * I, D), w2=mk(E, D, I),
                            gu=mk(2 * S * I, D), dn=mk(D, S * I)) for _ in range(self.LAYERS)]

    def shared(self, L, x):
        from deepinfer.backends.nvidia.activation import silu_and_mul

        return F.linear(silu_and_mul(F.linear(x, L["gu"])), L["dn"])

    def old(self, L, x):
        """The pre-fusion layer: router, align, gate_up GEMM, SiLU, down GEMM, sum, cast, shared MLP, add."""
        from deepinfer.backends.nvidia.activation import silu_and_mul
        from deepinfer.backends.nvidia.fused_moe import pick_block_m
        from deepinfer.backends.nvidia.fused_moe_gemm import aligned_gemm

        w, ids = self.route(F.linear(x.float(), L["gate"]))
        T, n = x.shape[0], ids.numel()
        block_m = pick_block_m(n, self.E)
        sorted_ids, expert_ids, npad = self.align(ids, self.E, block_m)
        h13 = torch.empty((n, 2 * self.I), dtype=x.dtype, device=x.device)
        aligned_gemm(x, L["w13"], h13, sorted_ids, expert_ids, npad, n, self.K, block_m)
        h = silu_and_mul(h13)
        y = torch.empty((n, self.D), dtype=torch.float32, device=x.device)
        aligned_gemm(h, L["w2"], y, sorted_ids, expert_ids, npad, n, 1, block_m, w.reshape(-1))
        return y.view(T, self.K, self.D).sum(1).to(x.dtype) + self.shared(L, x)

    def new(self, L, x, direct=None):
        """TritonMoE.forward's schedule: direct + shared folded at small T, else aligned + fused add."""
        from deepinfer.backends.nvidia.fused_moe import fused_moe, use_direct
        from deepinfer.backends.nvidia.moe_routing import fused_router_max_tokens, gate_route, router_logits

        if x.shape[0] <= fused_router_max_tokens():
            w, ids = gate_route(x, L["gate"], self.spec, None, self.route_counters)
        else:
            w, ids = self.route(router_logits(x, L["gate"]))
        if direct is None:
            direct = use_direct(x.shape[0], self.K)
        if direct:
            return fused_moe(x, L["w13"], L["w2"], w, ids, shared_w=(L["gu"], L["dn"]), direct=True,
                             counters=self.counters)
        return fused_moe(x, L["w13"], L["w2"], w, ids, align=self.align, shared_out=self.shared(L, x), direct=False)

    def time(self, fn, x) -> float:
        return graph_ms(lambda: [fn(L, x) for L in self.layers]) / self.LAYERS

    def nbytes(self, x) -> int:
        """Weight bytes one layer must read: touched routed experts + shared MLP + router gate."""
        ids = self.route(F.linear(x.float(), self.layers[0]["gate"]))[1]
        return (int(ids.unique().numel()) + self.SHARED) * 3 * self.D * self.I * 2 + self.E * self.D * 4


def moe_bench(tokens_list=(1, 4, 16, 64, 256)) -> None:
    """Whole MoE layer (router + routed + shared experts), old vs new schedule, through CUDA-graph replay."""
    import os

    from deepinfer.backends.nvidia.fused_moe import use_direct

    b = MoEBench()
    for t in tokens_list:
        x = torch.randn(t, b.D, device=DEV, dtype=torch.bfloat16)
        L = b.layers[0]
        ref = b.old(L, x).float()
        err = float((b.new(L, x).float() - ref).norm() / ref.norm())
        nbytes = b.nbytes(x)
        old_ms, new_ms = b.time(b.old, x), b.time(b.new, x)
        emit(name="moe_layer", tokens=t, ms=new_ms, old_ms=old_ms, speedup=old_ms / new_ms, TBps=nbytes / new_ms / 1e9,
             old_TBps=nbytes / old_ms / 1e9, rel_err_vs_old=err)
        for var, label in (("DEEPINFER_MOE_FUSED_COMBINE", "combine kernel"), ("DEEPINFER_MOE_FUSED_ROUTER",
                                                                                "router + top-k kernels")):
            if t * b.K <= 64:  # A/B of the small-batch fusions: each one off
                os.environ[var] = "0"
                emit(name="moe_layer " + label, tokens=t, ms=b.time(b.new, x))
                os.environ.pop(var)
        if t <= 16:  # the other schedule, for the DEEPINFER_MOE_DIRECT_MAX_PAIRS choice
            other = not use_direct(t, b.K)
            label = "moe_layer " + ("direct" if other else "aligned")
            try:
                ms = b.time(lambda L_, x_: b.new(L_, x_, direct=other), x)
                emit(name=label, tokens=t, ms=ms, TBps=nbytes / ms / 1e9)
            except Exception as exc:
                emit(name=label, tokens=t, error=str(exc)[:200])


# router_bench's gate in a CPU dry run: the interpreter runs one program per token and 1-2 experts, so V2-Lite's
# 64 x 2048 gate cost that run ~40 s; 8 x 256 takes the same code paths (tile pick, overrides, error rows).
DRY_RUN_ROUTER_GATE = (8, 256)

ROUTER_TILES = (  # DEEPINFER_ROUTER_GEMV candidates (None: the default pick per token count)
    None,
    "2,1024,4",  # 3 values: the per-token GEMV at every size (the default before the token-tiled kernel)
    "8,4,256,4,2", "8,4,256,4,3", "8,4,256,4,6", "8,4,256,8,4", "8,4,512,8,3",  # the 64-token default's neighbours
    "4,4,256,4", "4,4,512,4", "8,2,512,4", "4,2,1024,4",  # 256 / 512 programs at 64 tokens
    "8,8,128,4", "16,4,128,4", "2,2,1024,4", "1,1,1024,4",  # 64 programs (more reuse), smaller tiles
)


def router_bench(tokens_list=(1, 4, 16, 32, 64), tiles=ROUTER_TILES) -> None:
    """fp32 router logits at V2-Lite shapes, us per call by CUDA-graph replay over enough gates (> 2x L2)
    that each call reads its gate from HBM as in a decode step: cuBLAS on x.float() (old), the per-token
    GEMV, the token-tiled GEMV's default and candidate tiles (DEEPINFER_ROUTER_GEMV); max abs error vs
    F.linear in fp64 and whether two calls give the same bits. Plus logits + top-k against the fused router +
    top-k (gate_route), for the MoE op's choice between them ("same": expert ids equal the cuBLAS logits')."""
    import os

    from deepinfer.backends.nvidia.moe_routing import _gemv_tile, _tiled_gemv_tile, gate_route, route, router_logits

    if DEV == "cuda":
        E, D = MoEBench.E, MoEBench.D
        n = max(8, -(-2 * torch.cuda.get_device_properties(DEV).L2_cache_size // (E * D * 4)))
    else:  # a CPU dry run (Triton interpreter): one small gate, the same code paths
        (E, D), n = DRY_RUN_ROUTER_GATE, 1
    gates = [torch.randn(E, D, device=DEV) * 0.02 for _ in range(n)]
    spec = RouterSpec(E, MoEBench.K, "softmax", "greedy")
    # the Triton top-k, not the CUDA C++ one: building that extension on a fresh machine takes longer than
    # this whole benchmark (routing_bench compares the two top-k kernels)
    topk = lambda logits: route(logits, spec)  # noqa: E731
    counters = torch.zeros(64, dtype=torch.int32, device=DEV)
    # row label -> {tokens: us, "err": worst max abs error, "same": deterministic (gate_route: same ids)}
    labels = ["cuBLAS x.float() (old)", *(tile or "default" for tile in tiles), "cuBLAS + Triton top-k",
              "default + Triton top-k", "router+top-k gate_route"]
    table: dict[str, dict] = {label: {"err": None, "same": None} for label in labels}

    def record(label, t, ms, err=None, same=None):
        row = table[label]
        row[t] = ms * 1e3
        if err is not None:
            row["err"] = max(row["err"] or 0.0, err)
        if same is not None:
            row["same"] = same if row["same"] is None else row["same"] and same

    for t in tokens_list:
        x = torch.randn(t, D, device=DEV, dtype=torch.bfloat16)
        ref = F.linear(x.double(), gates[0].double())
        nbytes = E * D * 4 + t * D * 2 + t * E * 4
        old = graph_ms(lambda: [F.linear(x.float(), g) for g in gates]) / n
        record("cuBLAS x.float() (old)", t, old, float((F.linear(x.float(), gates[0]) - ref).abs().max()))
        emit(name="router_logits cuBLAS", tokens=t, ms=old, TBps=nbytes / old / 1e9)
        for tile in tiles:
            if t == 1 and tile and len(tile.split(",")) > 3:
                continue  # one token always takes the per-token GEMV
            if tile:
                os.environ["DEEPINFER_ROUTER_GEMV"] = tile
            label = tile or "default"
            used = ",".join(map(str, _gemv_tile(D) if t == 1 else _tiled_gemv_tile(t, E, D))) if not tile else tile
            try:
                out = router_logits(x, gates[0])
                err = float((out.double() - ref).abs().max())
                same = torch.equal(router_logits(x, gates[0]), out)
                ms = graph_ms(lambda: [router_logits(x, g) for g in gates]) / n
            except Exception as exc:  # an out-of-resources tile is a result, not a crash
                emit(name="router_logits", tokens=t, tile=label, error=str(exc)[:200])
                continue
            finally:
                os.environ.pop("DEEPINFER_ROUTER_GEMV", None)
            record(label, t, ms, err, same)
            if not tile:
                table[label].setdefault("used", []).append(f"T={t}: {used}")
            emit(name="router_logits", tokens=t, tile=label, tile_used=used, ms=ms, old_ms=old, speedup=old / ms,
                 TBps=nbytes / ms / 1e9, max_abs_err=err, deterministic=same)
        if t <= counters.numel():
            route_ms = graph_ms(lambda: [topk(F.linear(x.float(), g)) for g in gates]) / n
            tiled_ms = graph_ms(lambda: [topk(router_logits(x, g)) for g in gates]) / n
            fused = graph_ms(lambda: [gate_route(x, g, spec, None, counters) for g in gates]) / n
            same = torch.equal(gate_route(x, gates[0], spec, None, counters)[1], topk(F.linear(x.float(), gates[0]))[1])
            record("cuBLAS + Triton top-k", t, route_ms)
            record("default + Triton top-k", t, tiled_ms, same=torch.equal(topk(router_logits(x, gates[0]))[1],
                                                                           topk(F.linear(x.float(), gates[0]))[1]))
            record("router+top-k gate_route", t, fused, same=same)
            emit(name="router+topk", tokens=t, ms=fused, old_ms=route_ms, speedup=route_ms / fused, same_ids=same,
                 tiled_logits_topk_ms=tiled_ms)

    print(f"\nrouter logits, {'V2-Lite' if DEV == 'cuda' else 'dry-run'} gate {E} x {D} fp32, bf16 x: us per call "
          f"(graph replay over {n} gates)")
    print(f"{'tile':<26}" + "".join(f"{'T=' + str(t):>9}" for t in tokens_list) + "   max_abs_err  same bits/ids")
    for label, row in table.items():
        cells = "".join(f"{row[t]:>9.2f}" if t in row else f"{'-':>9}" for t in tokens_list)
        err = f"{row['err']:>11.2e}" if row["err"] is not None else f"{'-':>11}"
        print(f"{label:<26}{cells}   {err}  {'-' if row['same'] is None else row['same']}")
    if "default" in table:
        print("default tiles (BLOCK_T,BLOCK_E,BLOCK_D,warps,stages; T=1: BLOCK_E,BLOCK_D,warps of the per-token GEMV): "
              + "; ".join(table["default"].get("used", [])))


def moe_tile_sweep() -> None:
    """Tile choices (graph replay): aligned at 256 tokens, direct at 1 (BN counts gate + up rows)."""
    import os

    b = MoEBench()
    sweeps = (
        ("DEEPINFER_MOE_TILE", (256,), ("128,128,8,3", "128,64,4,3", "256,64,8,3")),
        ("DEEPINFER_MOE_DIRECT_TILE", (1,), ("64,128,4,4", "32,128,4,4", "128,128,4,3", "64,256,4,3")),
    )
    for var, tokens, tiles in sweeps:
        for t in tokens:
            x = torch.randn(t, b.D, device=DEV, dtype=torch.bfloat16)
            nbytes = b.nbytes(x)
            for tile in tiles:
                os.environ[var] = tile
                try:
                    ms = b.time(b.new, x)
                    emit(name="moe_tile", env=var, tokens=t, tile=tile, ms=ms, TBps=nbytes / ms / 1e9)
                except Exception as exc:
                    emit(name="moe_tile", env=var, tokens=t, tile=tile, error=str(exc)[:200])
            os.environ.pop(var, None)


def routing_bench() -> None:
    from deepinfer.backends.nvidia import cuda_ext
    from deepinfer.backends.nvidia.moe_routing import moe_align, route

    ext = cuda_ext.load()
    for label, spec, bias in (
        ("v2-lite", RouterSpec(64, 6, "softmax", "greedy"), None),
        ("v3", RouterSpec(256, 8, "sigmoid", "noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                          routed_scaling_factor=2.5), torch.randn(256, device="cuda")),
    ):
        for t in (64, 4096):
            logits = torch.randn(t, spec.num_experts, device="cuda")
            tri = bench(lambda: route(logits, spec, bias))
            cu = bench(lambda: cuda_ext.grouped_topk(ext, logits, spec, bias))
            same = torch.equal(route(logits, spec, bias)[1], cuda_ext.grouped_topk(ext, logits, spec, bias)[1])
            emit(name="route", router=label, tokens=t, triton_ms=tri, cuda_ms=cu, same_ids=same)
    for t in (64, 4096):
        ids = torch.randint(0, 64, (t, 6), device="cuda")
        emit(name="moe_align", tokens=t, torch_ms=bench(lambda: moe_align(ids, 64, 16)),
             cuda_ms=bench(lambda: ext.moe_align(ids, 64, 16)))


BENCHES = ("copy", "mla", "moe", "router", "moe_tile", "routing")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHES), metavar="NAME[,NAME]",
                        help=f"comma-separated subset of {', '.join(BENCHES)} (the d2d copy, the ceiling, always runs)")
    parser.add_argument("--router-tokens", default="1,4,16,32,64", metavar="T[,T]",
                        help="token counts of the router benchmark (above DEEPINFER_ROUTER_GEMV_MAX_TOKENS, 64 by "
                             "default, the engine's router_logits sends a size to cuBLAS: raise it to time the GEMVs)")
    args = parser.parse_args(argv)
    names = set(args.only.split(","))
    router_tokens = tuple(int(t) for t in args.router_tokens.split(",") if t)
    if names - set(BENCHES):
        parser.error(f"--only: unknown benchmark(s) {sorted(names - set(BENCHES))}; choose from {', '.join(BENCHES)}")
    torch.manual_seed(0)
    emit(name="device", gpu=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__)
    copy_bandwidth()
    if "mla" in names:
        mla_decode_bench()

    def router() -> None:
        router_bench(router_tokens)

    for fn in (f for key, f in (("moe", moe_bench), ("router", router)) if key in names):
        try:  # a failure is a result row, the later benchmarks still run
            fn()
        except Exception as exc:
            emit(name=fn.__name__, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
    if "moe_tile" in names:
        try:
            moe_tile_sweep()
        except Exception as exc:
            emit(name="moe_tile", error=f"{type(exc).__name__}: {str(exc)[:2000]}")
    if "routing" in names:
        try:
            routing_bench()
        except Exception as exc:
            emit(name="cuda_ext", error=f"{type(exc).__name__}: {str(exc)[:2000]}")
    print("\nkernel                         ms      TB/s   note")
    for r in ROWS:
        if "ms" in r and r["name"].startswith("router_logits"):
            continue  # in router_bench's own table
        if "ms" in r:
            note = {k: (round(r[k], 4) if isinstance(r[k], float) else r[k])
                    for k in ("batch", "ctx", "block_n", "warps", "stages", "splits", "tokens", "tile", "env",
                              "old_ms", "speedup", "old_TBps", "rel_err_vs_old", "same_ids", "max_abs_err")
                    if k in r}
            print(f"{r['name']:<22} {r['ms']:>10.4f} {r.get('TBps', 0):>8.3f}   {note}")
        elif "error" in r:
            print(f"{r['name']:<22} ERROR {r['error'][:300]}")
        elif "triton_ms" in r or "torch_ms" in r:
            print(f"{r['name']:<22} {r}")


if __name__ == "__main__":
    main()
