"""Offline throughput of DeepInfer: prefill tokens/s and decode ms/step + output tokens/s per batch size.

Random prompt token ids (seeded), greedy, ignore_eos, so every request runs
exactly --output-len steps. Each batch size runs alone: its prompts are
prefilled (timed as prefill), then every following engine step is a decode
step of the whole batch (timed one by one; engine.step returns only after the
sampled ids are on the host, so wall time per step is the device time plus
the host's share). Prints JSON lines, then a table; the roofline floor from
benchmarks/roofline.py sits beside each row.

  python -m benchmarks.throughput /tmp/ckpt --batch-sizes 1,16,64,256 --prompt-len 1024 --output-len 512

--async-scheduling on|off picks the engine's step pipeline (default: the engine's choice, on for
GPUs); with it on, engine.step returns the previous step's tokens while the device runs the
next one, so ms/step approaches max(host, device). Each decode row also reports the time spent
in Python's cyclic GC during decode (gc.callbacks), and --profile-batch B prints a cProfile of
the LAST --profile-steps decode steps at batch B (where per-token host costs are largest).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch


def _commit() -> str:
    from deepinfer import envs

    if envs.COMMIT.is_set():  # the GPU machine gets a copy of the tree without .git
        return envs.COMMIT.get()
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class GCTimer:
    """Time spent in the cyclic garbage collector while active (gc.callbacks), per generation."""

    def __init__(self):
        self.active = False
        self.total_s = 0.0
        self.max_s = 0.0
        self.count = {0: 0, 1: 0, 2: 0}
        self._t = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if not self.active:
            return
        if phase == "start":
            self._t = time.perf_counter()
        else:
            dt = time.perf_counter() - self._t
            self.total_s += dt
            self.max_s = max(self.max_s, dt)
            self.count[info["generation"]] += 1

    def __enter__(self):
        import gc

        self.active = True
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        import gc

        self.active = False
        gc.callbacks.remove(self)

    def summary(self) -> dict:
        return {"gc_ms_total": 1e3 * self.total_s, "gc_ms_max": 1e3 * self.max_s,
                "gc_collections": [self.count[g] for g in (0, 1, 2)]}


def graph_replay_ms(engine, batch: int) -> float | None:
    """Device time of the forward alone: replay this batch's captured decode graph on the inputs of the
    last step it ran. Call it mid-run, when that step held the whole batch: after a run the last step
    holds only the sequences that finished last (the others are padding rows that read no KV), which
    made an earlier version of this benchmark report replays far below the real steps (2026-12-01:
    5.96 ms for 4 live rows of 8 at 32k tokens, against 7.77 ms with the full batch)."""
    gr = getattr(engine.runner, "graph_runner", None)
    if gr is None or not torch.cuda.is_available() or not gr.graphs:
        return None
    size = gr.bucket_for(batch)
    if size is None or size not in gr.graphs:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gr.graphs[size].replay()
    start.record()
    for _ in range(20):
        gr.graphs[size].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


_PREFILL_ROUNDS = itertools.count()


def run_prefill(engine, n: int, prompt_len: int, vocab: int, seed: int) -> dict:
    """Prefill only: n prompts, one output token each, so no decode step mixes in.

    Every call draws NEW prompts (a round counter in the seed): the warm-up before a measured call has the
    same shapes but other tokens, so the measured prompts are not prefix-cache hits (prefix caching is on by
    default). Until 2026-12-03 both calls drew the same prompts and the measured "prefill" recomputed only
    each prompt's last block. `cached_tokens` (from RequestOutput.num_cached_tokens) says what was reused."""
    from deepinfer.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed + 99 + 7919 * next(_PREFILL_ROUNDS))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"p{i}", torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist(), params)
    t0 = time.perf_counter()
    steps = 0
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.num_cached_tokens is not None:
                cached[out.request_id] = out.num_cached_tokens
        steps += 1
    dt = time.perf_counter() - t0
    return {"bench": "prefill", "prompts": n, "prompt_len": prompt_len, "steps": steps, "seconds": dt,
            "prefill_tok_s": n * prompt_len / dt, "cached_tokens": sum(cached.values())}


def run_batch(engine, batch: int, prompt_len: int, output_len: int, vocab: int, seed: int,
              profile_steps: int = 0, step_timing: bool = False) -> dict:
    """profile_steps > 0: cProfile the last that many decode steps and print the top entries.
    step_timing: stream events per decode step (worker/step_timer.py): device time per phase,
    device idle between steps, host wait; reported for all decode steps and the last 32."""
    import cProfile
    import pstats

    from deepinfer.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed + batch)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
        engine.add_request(rid, prompt, params)
    generated = {rid: 0 for rid in ids}
    t0 = time.perf_counter()
    while min(generated.values()) < 1:  # prefill (chunked by the token budget)
        for out in engine.step():
            generated[out.request_id] = len(out.outputs[0].token_ids)
    t_prefill = time.perf_counter() - t0
    step_times = []
    decoded = 0
    prof = cProfile.Profile() if profile_steps else None
    first_profiled = max(0, output_len - 2 - profile_steps)  # about output_len - 1 decode steps follow
    profiled = 0
    gc_timer = GCTimer()
    timer = None
    if step_timing:
        from deepinfer.worker.step_timer import StepTimer

        timer = engine.runner.timer = StepTimer(torch.device(engine.runner.device))
    fallbacks0 = engine.stats().num_sync_fallbacks
    graph_ms = None
    graph_at = max(1, output_len // 2)  # a decode step that holds every sequence of the batch
    t1 = time.perf_counter()
    with gc_timer:
        while engine.has_unfinished_requests():
            profiling = prof is not None and len(step_times) >= first_profiled and profiled < profile_steps
            s = time.perf_counter()
            if profiling:
                prof.enable()
            outs = engine.step()
            if profiling:
                prof.disable()
                profiled += 1
            step_times.append(time.perf_counter() - s)
            decoded += len(outs)
            if len(step_times) == graph_at and graph_ms is None:
                pause = time.perf_counter()
                graph_ms = graph_replay_ms(engine, batch)  # the graph's inputs: the step just launched
                if timer is not None:
                    timer.exclude_next_gap()  # the replays ran on the device between two steps
                t1 += time.perf_counter() - pause  # not decode time
    t_decode = time.perf_counter() - t1
    timing = {}
    if timer is not None:
        engine.runner.timer = None
        timing = {"step_timing": timer.summary(), "step_timing_late": timer.summary(last=32)}
    if prof is not None:
        print(f"\nhost profile: the last {profiled} decode steps at batch {batch} (steps {first_profiled}.."
              f"{first_profiled + profiled - 1} of {len(step_times)}), sorted by own time; async scheduling "
              f"{'on' if engine.async_scheduling else 'off'}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(12)
    return {
        **gc_timer.summary(), **timing,
        "sync_fallbacks": engine.stats().num_sync_fallbacks - fallbacks0,
        "late_ms_per_step_median": 1e3 * statistics.median(step_times[-32:]) if step_times else None,
        "graph_replay_ms": graph_ms,
        "batch": batch, "prompt_len": prompt_len, "output_len": output_len,
        "prefill_s": t_prefill, "prefill_tok_s": batch * prompt_len / t_prefill,
        "decode_steps": len(step_times), "decode_s": t_decode,
        "decode_ms_per_step_median": 1e3 * statistics.median(step_times) if step_times else None,
        "decode_ms_per_step_mean": 1e3 * t_decode / max(1, len(step_times)),
        "output_tok_s": decoded / t_decode if t_decode else None,
        "avg_context": prompt_len + output_len / 2,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--output-len-small", type=int, default=None, help="output length for batch <= 16 (default: same)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--bandwidth-tbs", type=float, default=4.24, help="measured copy bandwidth for the roofline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-batch", type=int, default=0, help="cProfile the last decode steps at this batch (0: skip)")
    p.add_argument("--profile-steps", type=int, default=16, help="how many of the last decode steps to profile")
    p.add_argument("--step-timing", action="store_true",
                   help="time each decode step's phases on the device with stream events (idle vs busy)")
    p.add_argument("--async-scheduling", choices=["on", "off"], default=None,
                   help="overlap the host's step work with the device (default: the engine's choice)")
    p.add_argument("--prefill-prompts", type=int, default=64, help="prompts in the prefill-only run (0: skip)")
    p.add_argument("--quantization", default=None, help="EngineConfig.quantization (e.g. fp8: W8A8 online on a bf16 "
                   "checkpoint; issue 18's speed rows)")
    p.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig.kv_cache_dtype (auto, fp8)")
    p.add_argument("--kernel-profile", default="", help="after the timings, torch.profiler tables of a few decode "
                   "steps at these batch sizes (comma list) on this engine (benchmarks/profile_step.py)")
    p.add_argument("--prefill-profile", action="store_true", help="after the timings, torch.profiler and cProfile "
                   "tables of one prefill-only run (benchmarks/profile_region.py)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--accuracy-out", default=None,
                   help="also generate 16 greedy tokens for mixed-length prompts and save them for hf_baseline.py")
    args = p.parse_args()

    from benchmarks.quant_summary import quant_summary
    from benchmarks.roofline import floor_ms
    from deepinfer import LLM

    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.profile_batch and args.profile_batch not in batches:
        p.error(f"--profile-batch {args.profile_batch} must be one of --batch-sizes {args.batch_sizes}")
    max_len = args.prompt_len + max(args.output_len, args.output_len_small or 0) + 16
    t = time.perf_counter()
    engine = LLM(model=args.model, device=args.device, dtype="bfloat16", max_num_seqs=max(batches),
                 max_model_len=max_len, enforce_eager=args.enforce_eager,
                 max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization,
                 kv_cache_dtype=args.kv_cache_dtype,
                 async_scheduling=None if args.async_scheduling is None else args.async_scheduling == "on")
    load_s = time.perf_counter() - t
    with open(f"{args.model}/config.json") as f:
        cfg = json.load(f)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    graphs = getattr(engine.runner, "graph_runner", None) is not None
    meta = {"bench": "throughput", "gpu": gpu, "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
            time.gmtime()), "backend": engine.backend_name, "cuda_graphs": graphs, "load_s": load_s,
            "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
            "async_scheduling": engine.async_scheduling,
            "coverage": engine.backend.op_coverage(), "quant_summary": quant_summary(engine.runner.model)}
    print(json.dumps(meta), flush=True)
    if args.accuracy_out:
        from deepinfer.sampling_params import SamplingParams

        g = torch.Generator().manual_seed(args.seed + 7)
        prompts = [torch.randint(10, int(cfg["vocab_size"]) - 10, (n,), generator=g).tolist()
                   for n in (7, 100, 333, 1000)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        with open(args.accuracy_out, "w") as f:
            json.dump({"prompts": prompts, "outputs": [o.outputs[0].token_ids for o in outs]}, f)
    prefill = None
    if args.prefill_prompts:
        # warm-up at the measured run's own step shapes: a 4-prompt warm-up left kernels whose launch
        # configuration depends on the step's token count (the MoE's BLOCK_M) to compile inside the measured run
        run_prefill(engine, args.prefill_prompts, args.prompt_len, int(cfg["vocab_size"]), args.seed)
        prefill = run_prefill(engine, args.prefill_prompts, args.prompt_len, int(cfg["vocab_size"]), args.seed)
        print(json.dumps(prefill), flush=True)
    rows = []
    for b in batches:
        out_len = args.output_len_small if (args.output_len_small and b <= 16) else args.output_len
        r = run_batch(engine, b, args.prompt_len, out_len, int(cfg["vocab_size"]), args.seed,
                      args.profile_steps if b == args.profile_batch else 0, args.step_timing)
        r["roofline_ms"] = floor_ms(cfg, b, int(r["avg_context"]), args.bandwidth_tbs)
        r.update(bench="throughput", cuda_graphs=graphs)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.kernel_profile and torch.cuda.is_available():  # after the timings, on the same engine
        from benchmarks.profile_step import print_kernel_profiles

        print_kernel_profiles(engine, [int(b) for b in args.kernel_profile.split(",")], args.prompt_len,
                              int(cfg["vocab_size"]), f"quantization={args.quantization}")
    if args.prefill_profile and args.prefill_prompts and torch.cuda.is_available():
        from benchmarks.profile_region import profile_region

        dev = profile_region(f"prefill {args.prefill_prompts} x {args.prompt_len}, quantization={args.quantization}",
                       lambda: run_prefill(engine, args.prefill_prompts, args.prompt_len, int(cfg["vocab_size"]),
                                           args.seed),
                       os.path.join(tempfile.gettempdir(), "prefill_throughput.json"), host_lines=12)
        if prefill is not None:  # (in --json-out: benchmarks.quant_summary's ceiling reads its kernel classes)
            prefill["profile"] = {k: dev[k] for k in ("wall_ms", "device_busy_ms", "kernel_sum_ms", "classes_ms")}
    if args.json_out:
        with open(args.json_out, "w") as f:
            for r in [meta, *([prefill] if prefill else []), *rows]:
                f.write(json.dumps(r) + "\n")
    print(f"\n{gpu}, commit {meta['commit']}, CUDA graphs {'on' if graphs else 'off'}, "
          f"async scheduling {'on' if engine.async_scheduling else 'off'}")
    qs = meta["quant_summary"]
    print(f"linears by scheme {qs['linears']}, MoE layers' routed experts {qs['moe_layers_experts']} "
          f"({qs['routed_expert_bytes'] / 2**30:.2f} GiB)")
    if prefill:
        print(f"prefill only: {prefill['prompts']} x {prefill['prompt_len']} tokens, "
              f"{prefill['prefill_tok_s']:.0f} tok/s ({prefill['steps']} steps)")
    print(f"{'batch':>5} {'prefill tok/s':>13} {'ms/step':>8} {'late ms':>8} {'graph ms':>8} {'floor ms':>8} "
          f"{'out tok/s':>10} {'gc ms':>7} {'gc n (g0/g1/g2)':>16}")
    for r in rows:
        gms = f"{r['graph_replay_ms']:.2f}" if r.get("graph_replay_ms") else "-"
        gcn = "/".join(str(c) for c in r["gc_collections"])
        print(f"{r['batch']:>5} {r['prefill_tok_s']:>13.0f} {r['decode_ms_per_step_median']:>8.2f} "
              f"{r['late_ms_per_step_median']:>8.2f} {gms:>8} {r['roofline_ms']:>8.2f} {r['output_tok_s']:>10.0f} "
              f"{r['gc_ms_total']:>7.1f} {gcn:>16}")
    for r in rows:
        for key in ("step_timing", "step_timing_late"):
            if key in r:
                t = r[key]
                print(f"batch {r['batch']} {key}: " + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items()))


if __name__ == "__main__":
    main()
