"""MLA attention-side microbenchmarks on the GPU at DeepSeek-V2-Lite shapes, timed through CUDA-graph replay.

1. The attention layer of one decode step, from the normed hidden state to o_proj's output,
   old schedule vs new, at batch 1 / 64 / 256 (context 1024):
   - old: q_proj and kv_a_proj GEMMs, rms_norm(kv_c.contiguous()), q_pe / k_pe .contiguous(), RoPE,
     torch.cat, KV write, W_UK bmm, split-KV decode with the batch-only split count (every split
     used, however short), merge, W_UV bmm, the transposed reshape copy, o_proj;
   - new: one merged GEMM, the fused mla_prep kernel (norm + RoPE + KV write, q_pe in place, and the
     W_UK absorb in the same launch), the copy-free decode with decode_params' split sizing, o_proj;
   - "new, bmm absorb": the same with the W_UK absorb as a cuBLAS batched GEMM (fuse_absorb=False).
   LAYERS distinct weight / cache sets per graph so weights stream from HBM as in a real step.
2. MLA decode alone: a split / tile / min-split sweep at batch 1, 16, 64, 256 x context 1024, 1536,
   4096 (latent cache bytes / time = TB/s), the heuristic's pick against the best found.

Run on the GPU machine:  python -m benchmarks.kernels_mla [--quick]   (JSON lines + a compact table, < 60 s)
Code-path check on a CPU:  TRITON_INTERPRET=1 python -m benchmarks.kernels_mla --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from benchmarks.graph_timing import graph_ms as timed_by_graph
from deepinfer import envs

H, NOPE, ROPE, L, V, D, PAGE = 16, 128, 64, 512, 128, 2048, 64
LAYERS = 4
DEV = "cuda"  # the benchmark is for the GPU; a CPU smoke run (TRITON_INTERPRET=1) may set "cpu"
ROWS: list[dict] = []


def emit(**row) -> None:
    row["bench"] = "kernels_mla"
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def graph_ms(fn, inner: int = 1, reps: int = 15) -> float:
    """ms per fn() call through CUDA-graph replay (benchmarks/graph_timing.py); a CPU dry run just calls fn."""
    return timed_by_graph(fn, inner, reps, dry_run=DEV != "cuda", dry_value=float("nan"))


def paged(batch: int, ctx: int, dev: str | None = None):
    """A shuffled paged latent cache holding `ctx` tokens per sequence (+ room for the new one)."""
    dev = dev or DEV
    per = -(-(ctx + 1) // PAGE)
    cache = torch.randn(batch * per, PAGE, L + ROPE, device=dev, dtype=torch.bfloat16)
    table = torch.randperm(batch * per, device=dev).view(batch, per).int()
    return cache, table


# ---------------------------------------------------------------- 1. the attention layer, old vs new


class Layer:
    def __init__(self, batch: int, ctx: int, backend, g: torch.Generator):
        from deepinfer.backend import MLASpec
        from deepinfer.backends.nvidia.mla_attention import TritonMLAAttention

        bf = dict(device=DEV, dtype=torch.bfloat16)
        self.wq = (torch.randn(H * (NOPE + ROPE), D, generator=g) * D**-0.5).to(**bf)
        self.wkv = (torch.randn(L + ROPE, D, generator=g) * D**-0.5).to(**bf)
        self.wcat = torch.cat([self.wq, self.wkv])
        self.wo = (torch.randn(D, H * V, generator=g) * (H * V) ** -0.5).to(**bf)
        self.norm_w = torch.ones(L, **bf)
        self.op = TritonMLAAttention(MLASpec(H, NOPE, ROPE, V, L, (NOPE + ROPE) ** -0.5))
        self.op.load_kv_b_proj((torch.randn(H * (NOPE + V), L, generator=g) * L**-0.5).to(**bf))
        self.cache, self.table = paged(batch, ctx)
        self.backend = backend


def step_batch(batch: int, ctx: int, table: torch.Tensor):
    from deepinfer.backend.forward_batch import ForwardBatch

    dev = DEV
    pos = torch.full((batch,), ctx, dtype=torch.int64, device=dev)
    slots = table[:, ctx // PAGE].long() * PAGE + ctx % PAGE
    return ForwardBatch(
        input_ids=torch.zeros(batch, dtype=torch.int64, device=dev), positions=pos,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), ctx + 1, dtype=torch.int32, device=dev),
        context_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        block_tables={"mla": table}, slot_mapping={"mla": slots}, logits_indices=torch.arange(batch, device=dev),
        query_lens_cpu=[1] * batch, seq_lens_cpu=[ctx + 1] * batch, context_lens_cpu=[ctx] * batch, block_size=PAGE,
    )


def old_attention(lay: Layer, x, pos, cs, fb):
    from deepinfer.backends.nvidia.kv_write import kv_cache_write_parts
    from deepinfer.backends.nvidia.mla_decode import default_num_splits, mla_decode
    from deepinfer.backends.nvidia.rmsnorm import rms_norm
    from deepinfer.backends.nvidia.rope import rotary_embedding

    t = x.shape[0]
    q = F.linear(x, lay.wq).view(t, H, NOPE + ROPE)
    kv_c, k_pe = F.linear(x, lay.wkv).split([L, ROPE], dim=-1)
    kv_c = rms_norm(kv_c.contiguous(), lay.norm_w, 1e-6)
    q_pe, k_pe = rotary_embedding(pos, q[..., NOPE:].contiguous(), k_pe.contiguous().view(t, 1, ROPE), cs, True)
    q = torch.cat([q[..., :NOPE], q_pe], dim=-1)
    kv_cache_write_parts(lay.cache, fb.slot_mapping["mla"], kv_c, k_pe.reshape(t, ROPE))
    q_lat = torch.bmm(q[..., :NOPE].transpose(0, 1), lay.op.w_uk).transpose(0, 1)
    o_lat = mla_decode(q_lat, lay.cache, fb.block_tables["mla"], fb.seq_lens, L, lay.op.spec.softmax_scale,
                       q_pe=q[..., NOPE:],
                       num_splits=default_num_splits(t, H), block_n=32, min_split=32)
    out = torch.bmm(o_lat.transpose(0, 1), lay.op.w_uv_t).transpose(0, 1).reshape(t, -1)
    return F.linear(out, lay.wo)


def new_attention(lay: Layer, x, pos, cs, fb):
    t = x.shape[0]
    q, kv_a = F.linear(x, lay.wcat).split([H * (NOPE + ROPE), L + ROPE], dim=-1)
    out = lay.op.forward_from_latent(q.view(t, H, NOPE + ROPE), kv_a, lay.norm_w, 1e-6, pos, cs, True, lay.cache,
                                     fb, "mla", lay.backend)
    return F.linear(out, lay.wo)


def attention_layers(batches: list[int], ctx: int = 1024) -> None:
    from deepinfer.backend.native.rope import rope_cos_sin_cache
    from deepinfer.backends.nvidia.backend import NvidiaBackend

    backend = NvidiaBackend(device=DEV, use_cuda_ext=False)
    cs = rope_cos_sin_cache(ROPE, 8192, 10000.0, None).to(DEV)
    g = torch.Generator().manual_seed(0)
    for b in batches:
        layers = [Layer(b, ctx, backend, g) for _ in range(LAYERS)]
        fbs = [step_batch(b, ctx, lay.table) for lay in layers]
        x = torch.randn(b, D, device=DEV, dtype=torch.bfloat16)
        pos = fbs[0].positions
        # same numbers both ways (fresh copies of the caches, the new path last)
        ref = old_attention(layers[0], x, pos, cs, fbs[0])
        got = new_attention(layers[0], x, pos, cs, fbs[0])
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        res = {}
        for name, fn, fused in (("old", old_attention, True), ("new_bmm", new_attention, False),
                                ("new", new_attention, True)):
            for lay in layers:
                lay.op.fuse_absorb = fused
            res[name] = graph_ms(lambda fn=fn: [fn(lay, x, pos, cs, fb) for lay, fb in zip(layers, fbs)]) / LAYERS
        emit(name="attention_layer", batch=b, ctx=ctx, old_us=res["old"] * 1e3, new_us=res["new"] * 1e3,
             new_bmm_absorb_us=res["new_bmm"] * 1e3, saved_us=(res["old"] - res["new"]) * 1e3, rel_err=err)
        del layers, fbs
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- 2. decode split / tile sweep


def _split_len(ctx: int, splits: int, block_n: int, min_split: int) -> int:
    per = -(-(-(-ctx // splits)) // block_n) * block_n
    return max(per, min_split)


def decode_sweep(batches: list[int], contexts: list[int], quick: bool, budget_s: float,
                 split_list: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), tile_min_only: bool = False) -> None:
    """tile_min_only: each split count with min split = one tile only (exactly that many splits)."""
    from deepinfer.backends.nvidia.mla_decode import decode_params, mla_decode

    cell_budget = budget_s / (len(batches) * len(contexts))
    tiles = [(32, 4, 3), (64, 8, 2)]  # (tile, warps, stages); deeper pipelines next: batch 64 at 1.5k is ~2 TB/s
    if not quick:
        tiles += [(32, 4, 2), (32, 4, 4), (32, 8, 3), (16, 4, 3)]
    for b in batches:
        for ctx in contexts:
            cache, table = paged(b, ctx)
            seq = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
            q = torch.randn(b, H, L + ROPE, device=DEV, dtype=torch.bfloat16)
            nbytes = b * ctx * (L + ROPE) * 2
            auto = decode_params(b, H, 1 << 17)  # a captured graph's table: the split count from the batch only
            out = mla_decode(q, cache, table, seq, L, 0.1, num_splits=auto.num_splits, block_n=auto.block_n,
                             min_split=auto.min_split)
            kv = cache[table[0].long()].reshape(-1, L + ROPE)[:ctx].float()
            ref = ((q[0].float() @ kv.T) * 0.1).softmax(-1) @ kv[:, :L]
            err = float((out[0].float() - ref).norm() / ref.norm())
            configs = [(auto.num_splits, auto.block_n, auto.min_split, auto.num_warps, auto.num_stages, "auto"),
                       (auto.num_splits, auto.block_n, auto.min_split, auto.num_warps, auto.num_stages, "separate")]
            seen = set()
            seen.add((auto.num_splits, auto.block_n, _split_len(ctx, auto.num_splits, auto.block_n, auto.min_split),
                      auto.num_warps, auto.num_stages))
            for bn, warps, stages in tiles:
                for splits in split_list:
                    if b * splits > 8192:
                        continue
                    for min_split in (bn,) if tile_min_only else (bn, 128, 256, 512):
                        key = (splits, bn, _split_len(ctx, splits, bn, min_split), warps, stages)
                        if key in seen or min_split < bn:
                            continue
                        seen.add(key)
                        configs.append((splits, bn, min_split, warps, stages, "sweep"))
            best, auto_row, separate_row, t0 = None, None, None, time.perf_counter()
            for splits, bn, min_split, warps, stages, kind in configs:
                if time.perf_counter() - t0 > cell_budget and kind == "sweep":
                    break
                if kind == "separate":  # the same launch with the merge as its own kernel (the fused merge's A/B)
                    os.environ["DEEPINFER_MLA_FUSED_MERGE"] = "0"
                try:
                    ms = graph_ms(lambda: mla_decode(q, cache, table, seq, L, 0.1, num_splits=splits, block_n=bn,
                                                     min_split=min_split, num_warps=warps, num_stages=stages),
                                  inner=5, reps=8)
                except Exception as exc:  # an out-of-resources tile is a result, not a crash
                    emit(name="mla_decode", batch=b, ctx=ctx, splits=splits, block_n=bn, min_split=min_split,
                         warps=warps, stages=stages, error=str(exc)[:160])
                    continue
                finally:
                    os.environ.pop("DEEPINFER_MLA_FUSED_MERGE", None)
                used = -(-ctx // _split_len(ctx, splits, bn, min_split))
                row = dict(name="mla_decode", batch=b, ctx=ctx, kind=kind, splits=splits, used_splits=used,
                           block_n=bn, min_split=min_split, warps=warps, stages=stages, us=ms * 1e3,
                           TBps=nbytes / ms / 1e9)
                emit(**row, rel_err=err if kind == "auto" else None)
                if kind == "auto":
                    auto_row = row
                elif kind == "separate":
                    separate_row = row
                    continue
                if best is None or ms * 1e3 < best["us"]:
                    best = row
            emit(name="mla_decode_summary", batch=b, ctx=ctx, auto=auto_row, best=best, rel_err=err,
                 separate=separate_row)
            del cache, table
            torch.cuda.empty_cache()


def table() -> None:
    print("\nattention layer per decode step (us per layer, CUDA-graph replay)")
    print(f"{'batch':>6} {'ctx':>5} {'old us':>8} {'new us':>8} {'saved':>7} {'new, bmm absorb':>16} {'rel_err':>8}")
    for r in ROWS:
        if r["name"] == "attention_layer":
            print(f"{r['batch']:>6} {r['ctx']:>5} {r['old_us']:>8.1f} {r['new_us']:>8.1f} {r['saved_us']:>7.1f} "
                  f"{r['new_bmm_absorb_us']:>16.1f} {r['rel_err']:>8.1e}")
    print("\nMLA decode (latent cache TB/s): heuristic pick vs best of the sweep  [splits used/launched, tile, min split]"
          "\n  (sep us: the auto launch with the merge as a separate kernel instead of in the split kernel)")
    print(f"{'batch':>6} {'ctx':>5} | {'auto us':>8} {'TB/s':>5} {'cfg':>18} | {'sep us':>7} | {'best us':>8} "
          f"{'TB/s':>5} {'cfg':>22}")
    for r in ROWS:
        if r["name"] != "mla_decode_summary":
            continue
        a, b = r["auto"], r["best"]
        if a is None or b is None:
            print(f"{r['batch']:>6} {r['ctx']:>5} | failed (see the JSON rows)")
            continue

        def cfg(x):
            return f"{x['used_splits']}/{x['splits']} n{x['block_n']} m{x['min_split']} w{x['warps']}s{x['stages']}"

        sep = f"{r['separate']['us']:>7.1f}" if r.get("separate") else f"{'-':>7}"
        print(f"{r['batch']:>6} {r['ctx']:>5} | {a['us']:>8.1f} {a['TBps']:>5.2f} {cfg(a):>18} | {sep} | "
              f"{b['us']:>8.1f} {b['TBps']:>5.2f} {cfg(b):>22}")


def main(argv: list[str] | None = None) -> None:
    global DEV, LAYERS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two tiles in the sweep instead of four")
    ap.add_argument("--budget", type=float, default=30.0, help="seconds for the decode sweep (the auto rows always run)")
    ap.add_argument("--batches", default="1,16,64,256", help="decode sweep batch sizes")
    ap.add_argument("--contexts", default="1024,1536,4096", help="decode sweep context lengths")
    ap.add_argument("--no-layers", action="store_true", help="skip the attention-layer comparison")
    ap.add_argument("--splits", default=None,
                    help="focused sweep: these split counts only, each with a one-tile minimum (e.g. 2,3,4,6,8)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, TRITON_INTERPRET=1, tiny contexts, no timing: checks the benchmark's code paths")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.dry_run:
        if envs.TRITON_INTERPRET.get() != "1":
            raise SystemExit("--dry-run needs TRITON_INTERPRET=1 in the environment")
        DEV, LAYERS = "cpu", 1
        # one batch of 2 (a batch dimension > 1, the same code paths as 1 / 3): every interpreted program
        # counts, and batches 1 + 3 took this run ~45 s
        attention_layers([2], ctx=40)
        decode_sweep([2], [40], quick=True, budget_s=1.0)
        table()
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernels_mla needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    if not args.no_layers:
        attention_layers([1, 64, 256])
    focus = dict(split_list=tuple(int(x) for x in args.splits.split(",")), tile_min_only=True) if args.splits else {}
    decode_sweep([int(x) for x in args.batches.split(",")], [int(x) for x in args.contexts.split(",")], args.quick,
                 args.budget, **focus)
    table()
    print(f"\n{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
