"""The cost of batch invariance on a GPU: decode tok/s at each batch size and prefill tok/s, flag off vs on.

One engine per setting, one after the other in the same process (flag off first; each engine is freed
before the next is built), the same random prompts (seeded), greedy, ignore_eos; the timing loops are
benchmarks/throughput.py's (run_batch, run_prefill). Prints JSON lines, then a table with the overhead
(1 - on / off) per row; --json-out writes every row.

  python -m benchmarks.batch_invariance /tmp/ckpt-v2-lite --batch-sizes 1,64,256 --prompt-len 512 --output-len 128

(make the V2-Lite random checkpoint first: python -m deepinfer.entrypoints.cli make-checkpoint --preset v2-lite
--workers 8 /tmp/ckpt-v2-lite; scripts/gpu_run.sh does it in its bench stage).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

from benchmarks.throughput import _commit, run_batch, run_prefill


def _engine(args, invariant: bool, batches: list[int]):
    from deepinfer import LLM

    return LLM(model=args.model, device=args.device, dtype="bfloat16", max_num_seqs=max(batches),
               max_model_len=args.prompt_len + args.output_len + 16, enforce_eager=args.enforce_eager,
               max_num_batched_tokens=args.max_num_batched_tokens, batch_invariant=invariant,
               gpu_memory_utilization=args.gpu_memory_utilization)


def _measure(args, invariant: bool, batches: list[int], vocab: int) -> list[dict]:
    t = time.perf_counter()
    engine = _engine(args, invariant, batches)
    meta = {"bench": "batch_invariance_meta", "batch_invariant": invariant, "load_s": time.perf_counter() - t,
            "cuda_graphs": getattr(engine.runner, "graph_runner", None) is not None,
            "async_scheduling": engine.async_scheduling, "coverage": engine.backend.op_coverage()}
    print(json.dumps(meta), flush=True)
    rows = []
    run_batch(engine, batches[0], 64, 8, vocab, args.seed)  # warm-up: Triton compiles outside the timings
    for b in batches:
        r = run_batch(engine, b, args.prompt_len, args.output_len, vocab, args.seed)
        r.update(bench="decode", batch_invariant=invariant)
        print(json.dumps(r), flush=True)
        rows.append(r)
    if args.prefill_prompts:
        # warm-up at the measured shapes first (as benchmarks/throughput.py does): kernels whose launch
        # configuration depends on the step's token count would otherwise compile inside the measured run
        run_prefill(engine, args.prefill_prompts, args.prompt_len, vocab, args.seed)
        # new prompts each run (no prefix-cache hits); the best of --prefill-runs, each a single ~50 ms step
        runs = [run_prefill(engine, args.prefill_prompts, args.prompt_len, vocab, args.seed)
                for _ in range(args.prefill_runs)]
        r = max(runs, key=lambda x: x["prefill_tok_s"])
        r["runs_tok_s"] = [round(x["prefill_tok_s"], 1) for x in runs]
        r["median_tok_s"] = sorted(r["runs_tok_s"])[len(runs) // 2]
        r.update(batch_invariant=invariant)
        print(json.dumps(r), flush=True)
        rows.append(r)
    if args.kernel_profile and torch.cuda.is_available():  # after the timings, on the same engine
        from benchmarks.profile_step import print_kernel_profiles

        print_kernel_profiles(engine, [int(b) for b in args.kernel_profile.split(",")], args.prompt_len, vocab,
                              f"batch_invariant={invariant}")
    if args.prefill_profile and args.prefill_prompts and torch.cuda.is_available():
        from benchmarks.profile_region import profile_region

        profile_region(f"prefill {args.prefill_prompts} x {args.prompt_len}, batch_invariant={invariant}",
                       lambda e=engine: run_prefill(e, args.prefill_prompts, args.prompt_len, vocab, args.seed),
                       os.path.join(tempfile.gettempdir(), f"prefill_inv{int(invariant)}.json"), host_lines=12)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-prompts", type=int, default=32, help="prompts in the prefill-only run (0: skip)")
    p.add_argument("--prefill-runs", type=int, default=3, help="prefill runs (new prompts each); the best is kept")
    p.add_argument("--device", default="cuda")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["off", "on"], default=None, help="measure one setting only")
    p.add_argument("--kernel-profile", default="", help="after the timings, torch.profiler tables of a few decode "
                   "steps at these batch sizes (comma list) on each engine (benchmarks/profile_step.py)")
    p.add_argument("--prefill-profile", action="store_true", help="after the timings, torch.profiler and cProfile "
                   "tables of one prefill-only run on each engine (benchmarks/profile_region.py)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with open(f"{args.model}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"bench": "batch_invariance", "gpu": gpu, "commit": _commit(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}), flush=True)
    settings = [False, True] if args.only is None else [args.only == "on"]
    rows = [r for inv in settings for r in _measure(args, inv, batches, vocab)]
    if args.json_out:
        with open(args.json_out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    by = {(r["bench"], r.get("batch"), r["batch_invariant"]): r for r in rows}
    print(f"\n{'row':<18}{'flag off':>14}{'flag on':>14}{'overhead':>10}")
    keys = [("decode", b) for b in batches] + ([("prefill", None)] if args.prefill_prompts else [])
    for bench, b in keys:
        field = "output_tok_s" if bench == "decode" else "prefill_tok_s"
        off, on = by.get((bench, b, False)), by.get((bench, b, True))
        name = f"decode b={b} tok/s" if bench == "decode" else "prefill tok/s"
        fmt = lambda r: f"{r[field]:>14.1f}" if r else f"{'-':>14}"  # noqa: E731
        over = f"{100 * (1 - on[field] / off[field]):>9.1f}%" if on and off else f"{'-':>10}"
        print(f"{name:<18}{fmt(off)}{fmt(on)}{over}")
        if bench == "prefill" and on and off:  # the runs' medians too: a single prefill step is noisy
            mo, mn = off["median_tok_s"], on["median_tok_s"]
            print(f"{'prefill median':<18}{mo:>14.1f}{mn:>14.1f}{100 * (1 - mn / mo):>9.1f}%")


if __name__ == "__main__":
    main()
