"""Where a decode step's time goes on the GPU: kernels by name, GPU-idle time, graph gaps.

For each batch size: prefill `batch` random prompts, decode a few warm-up steps, then
profile `--steps` engine steps with torch.profiler (CUPTI sees the kernels inside
replayed CUDA graphs). Reported per step:

- wall: engine.step() wall time (no sync between steps: with async scheduling one step stays in flight);
- gpu busy: the union of kernel / memcpy / memset intervals (so wall - busy is time the
  GPU sat idle waiting for the host);
- graph span / kernel sum: one replay of the batch's decode graph alone, first kernel
  start to last kernel end vs the sum of its kernel durations (the difference is the
  launch latency between dependent kernels that fusion would remove);
- graph launch (host): how long the replay() call itself holds the CPU, without the profiler;
- the top kernels by device time, with launches per step.

  python -m benchmarks.profile_step /tmp/ckpt --batch-sizes 1,64,256 --trace-dir $OUT
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _device_events(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("cat") in _DEVICE_CATS and "dur" in e]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _profile(fn, steps: int, trace_path: str, sync_each: bool) -> tuple[list[dict], list[float]]:
    """sync_each=False leaves the device queue alone between calls (async scheduling keeps one step in
    flight: a sync per step would serialize it); the one sync at the end closes the last step."""
    from torch.profiler import ProfilerActivity, profile

    walls: list[float] = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            t = time.perf_counter()
            fn()
            if torch.cuda.is_available() and (sync_each or i == steps - 1):
                torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - t))
    prof.export_chrome_trace(trace_path)
    return _device_events(trace_path), walls


def _by_name(events: list[dict], steps: int) -> list[tuple[str, float, float]]:
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        a = agg[e["name"][:90]]
        a[0] += e["dur"]
        a[1] += 1
    rows = [(name, us / steps, n / steps) for name, (us, n) in agg.items()]
    return sorted(rows, key=lambda r: -r[1])


def profile_batch(engine, batch: int, prompt_len: int, vocab: int, steps: int, trace_dir: str | None,
                  warm_steps: int = 3) -> dict:
    from benchmarks.throughput import graph_replay_ms
    from deepinfer.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(4321 + batch)
    params = SamplingParams(max_tokens=steps + warm_steps + 9, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"prof{batch}-{i}", torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist(),
                           params)
    started: set[str] = set()
    while len(started) < batch and engine.has_unfinished_requests():
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(warm_steps):  # decode steps before the profiled ones (a longer context, later routing)
        engine.step()
    path = os.path.join(trace_dir or tempfile.gettempdir(), f"trace_b{batch}.json")
    events, walls = _profile(engine.step, steps, path, sync_each=False)
    if not events:
        raise SystemExit("the profiler saw no device kernels (no CUDA device, or CUPTI unavailable)")
    busy = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in events]) / 1e3 / steps
    out = {"bench": "profile_step", "batch": batch, "steps": steps, "warm_steps": warm_steps,
           "wall_ms_median": statistics.median(walls), "gpu_busy_ms": busy,
           "kernel_sum_ms": sum(e["dur"] for e in events) / 1e3 / steps,
           "launches_per_step": len(events) / steps,
           "top": [(n, round(us, 1), round(c, 2)) for n, us, c in _by_name(events, steps)[:25]]}

    gr = getattr(engine.runner, "graph_runner", None)
    size = gr.bucket_for(batch) if gr is not None else None
    if size is not None and size in gr.graphs:
        gpath = os.path.join(tempfile.gettempdir(), f"graph_b{batch}.json")
        gev, _ = _profile(gr.graphs[size].replay, 3, gpath, sync_each=True)
        span = (max(e["ts"] + e["dur"] for e in gev) - min(e["ts"] for e in gev)) / 1e3 / 3
        launch = []
        for _ in range(10):  # host time of the launch call alone (no profiler attached)
            torch.cuda.synchronize()
            t = time.perf_counter()
            gr.graphs[size].replay()
            launch.append(1e3 * (time.perf_counter() - t))
        torch.cuda.synchronize()
        out.update(graph_launch_host_ms=statistics.median(launch), graph_bucket=size, graph_kernels=len(gev) / 3, graph_kernel_sum_ms=sum(e["dur"] for e in gev) / 3e3,
                   graph_span_ms=span, graph_replay_ms=graph_replay_ms(engine, batch),
                   graph_inputs=dict(input_ids=gr.static.input_ids[:batch].tolist(),
                                     seq_lens=gr.static.seq_lens[:batch].tolist()),
                   graph_top=[(n, round(us, 1), round(c, 2)) for n, us, c in _by_name(gev, 3)[:30]])
    while engine.has_unfinished_requests():
        engine.step()
    if size is not None and size in gr.graphs:  # the same graph and inputs once its requests are done
        gev, _ = _profile(gr.graphs[size].replay, 3, os.path.join(tempfile.gettempdir(), f"graph_after_b{batch}.json"),
                          sync_each=True)
        st = gr.static
        out.update(graph_inputs_after=dict(input_ids=st.input_ids[:batch].tolist(),
                                           seq_lens=st.seq_lens[:batch].tolist()))
        out.update(graph_after_kernel_sum_ms=sum(e["dur"] for e in gev) / 3e3,
                   graph_after_replay_ms=graph_replay_ms(engine, batch),
                   graph_after_top=[(n, round(us, 1), round(c, 2)) for n, us, c in _by_name(gev, 3)[:12]])
    if trace_dir:  # keep the trace small enough to bring back
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
            z.write(f.read())
        os.remove(path)
    return out


def print_kernel_profiles(engine, batches: list[int], prompt_len: int, vocab: int, label: str,
                          steps: int = 4, top: int = 15) -> list[dict]:
    """profile_batch for each of `batches` on an engine a benchmark already built (no second start-up), printing
    wall / device-busy per step and the top kernels; returns the rows (benchmarks' --kernel-profile)."""
    rows = []
    for b in batches:
        r = profile_batch(engine, b, prompt_len, vocab, steps, None)
        r["label"] = label
        rows.append(r)
        print(f"\n## kernel profile, {label}, batch {b}: wall {r['wall_ms_median']:.2f} ms/step, device busy "
              f"{r['gpu_busy_ms']:.2f} ms, kernel sum {r['kernel_sum_ms']:.2f} ms, {r['launches_per_step']:.0f} "
              f"launches/step" + (f", graph span {r['graph_span_ms']:.2f} ms" if "graph_span_ms" in r else ""),
              flush=True)
        for name, us, n in r["top"][:top]:
            print(f"  {us / 1e3:8.3f} ms {n:7.2f}x/step  {name}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warm-steps", type=int, default=3, help="decode steps before the profiled ones")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--trace-dir", default=None, help="write trace_b<batch>.json.gz here")
    p.add_argument("--trace-batches", default="1,64", help="which batch sizes keep their trace")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    from deepinfer import LLM

    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = LLM(model=args.model, device=args.device, dtype="bfloat16", max_num_seqs=max(batches),
                 max_model_len=args.prompt_len + args.steps + args.warm_steps + 64, enforce_eager=args.enforce_eager,
                 max_num_batched_tokens=16384)
    with open(f"{args.model}/config.json") as f:
        vocab = int(json.load(f)["vocab_size"])
    rows = []
    for b in batches:
        keep = args.trace_dir if str(b) in args.trace_batches.split(",") else None
        r = profile_batch(engine, b, args.prompt_len, vocab, args.steps, keep, args.warm_steps)
        rows.append(r)
        print(json.dumps(r), flush=True)
        print(f"\nbatch {b}: wall {r['wall_ms_median']:.2f} ms/step, GPU busy {r['gpu_busy_ms']:.2f} ms, "
              f"kernel sum {r['kernel_sum_ms']:.2f} ms, {r['launches_per_step']:.0f} device ops/step")
        if "graph_span_ms" in r:
            print(f"  graph (bucket {r['graph_bucket']}): {r['graph_kernels']:.0f} kernels, span "
                  f"{r['graph_span_ms']:.3f} ms, kernel sum {r['graph_kernel_sum_ms']:.3f} ms, "
                  f"replay {r['graph_replay_ms']:.3f} ms, launch call (host) {r['graph_launch_host_ms']:.3f} ms")
            for name, us, n in r["graph_top"]:
                print(f"    {us:9.1f} us  x{n:<6} {name}")
        if "graph_after_top" in r:
            print(f"  the same graph after its requests finished: kernel sum {r['graph_after_kernel_sum_ms']:.3f} ms, "
                  f"replay {r['graph_after_replay_ms']:.3f} ms")
            print(f"  static inputs mid-run {r['graph_inputs']}, after {r['graph_inputs_after']}")
            for name, us, n in r["graph_after_top"]:
                print(f"    {us:9.1f} us  x{n:<6} {name}")
        print("  step (outside + inside the graph):")
        for name, us, n in r["top"][:25]:
            print(f"    {us:9.1f} us  x{n:<6} {name}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
