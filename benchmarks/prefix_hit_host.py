"""The host cost of a full device prefix hit at long context, per phase, on the CPU (issue 15).

Why: on the H200 an 8k-token device hit of 4 V2-Lite layers took 11.6 ms although the one 64-token block it
recomputes costs ~1-2 ms on the GPU; the rest is host work that may grow with the prompt (hashing 128 block
keys, matching, attaching, block tables, request checks). This runs a tiny random-weight checkpoint (the
tiny-v2-lite preset, fp32, with max_position_embeddings raised so 32k prompts fit), warms the cache with a
prompt of --contexts tokens, then submits the same prompt again and times each phase of that hit by hand,
driving the engine's own pieces in the order the synchronous step runs them:

- add_request: request checks, prompt-id validation, seed, queueing;
- schedule: the scheduler, with the prefix match and the attach of the cached blocks;
- build: BatchBuilder.build (block tables, positions, slot mapping) — timed by a delegating wrapper;
- forward: the model forward and compute_logits (on a GPU this is ~1-2 ms at these shapes; on the CPU it is
  the model's fp32 compute, reported apart so it does not hide the host phases);
- draw: the rest of ModelRunner.launch (sampling rows, the draw, the host copy);
- advance: Scheduler.advance (computed-token bookkeeping, keying the newly computed blocks);
- process: reading the drawn id, stop checks, detokenizer, the RequestOutput.

host = everything but forward. Best of --reps per phase (each rep a fresh request id, same prompt).

    python -m benchmarks.prefix_hit_host --contexts 2048,8192,32768 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
PHASES = ("add_request", "schedule", "build", "forward", "draw", "advance", "process")


class Timed:
    """Delegates to `inner`, adding the wall time of the named methods' calls to `acc[phase]`."""

    def __init__(self, inner, methods: dict[str, str], acc: dict[str, float]):
        self._inner, self._methods, self._acc = inner, methods, acc

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        phase = self._methods.get(name)
        if phase is None:
            return attr

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                self._acc[phase] = self._acc.get(phase, 0.0) + time.perf_counter() - t

        return timed


def make_checkpoint_dir(out_dir: str, max_pos: int) -> str:
    from deepinfer.checkpoints import PRESETS, Preset, make_checkpoint, register_preset

    name = f"tiny-v2-lite-pos{max_pos}"
    if name not in PRESETS:
        base = PRESETS["tiny-v2-lite"]
        register_preset(Preset(name, f"{base.description}, max_position_embeddings {max_pos}",
                               {**base.config, "max_position_embeddings": max_pos}, dtype=base.dtype))
    path = os.path.join(out_dir, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        make_checkpoint(name, path, progress=False)
    return path


def hit_phases(engine: DeepInferenceEngine, prompt: list[int], rid: str, acc: dict[str, float]) -> dict[str, float]:
    """Run one request (expected to hit) through the synchronous step's pieces, timing each; ms per phase."""
    acc.clear()
    pipe, sched_, runner = engine._pipeline, engine.scheduler, engine.runner
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, ONE)
    t1 = time.perf_counter()
    sched = sched_.schedule()
    t2 = time.perf_counter()
    launched = runner.launch(sched)
    t3 = time.perf_counter()
    sched_.advance(sched)
    t4 = time.perf_counter()
    seqs = pipe._process(launched)
    outs = [engine.output_processor.make_output(s.request) for s in seqs]
    for s in seqs:
        engine._requests.pop(s.request.request_id, None)
    t5 = time.perf_counter()
    if len(outs) != 1 or not outs[0].finished:
        raise RuntimeError(f"the hit request did not finish in one step: {outs}")
    fwd, build = acc.get("forward", 0.0), acc.get("build", 0.0)
    ms = {"add_request": t1 - t0, "schedule": t2 - t1, "build": build, "forward": fwd,
          "draw": (t3 - t2) - build - fwd, "advance": t4 - t3, "process": t5 - t4}
    ms = {k: 1e3 * v for k, v in ms.items()}
    ms["cached_tokens"] = outs[0].num_cached_tokens or 0
    return ms


def run_context(path: str, ctx: int, reps: int, block: int) -> dict:
    engine = DeepInferenceEngine(EngineConfig(path, device="cpu", dtype="float32", enable_prefix_caching=True,
                                              max_model_len=ctx + 2 * block, load_progress=False,
                                              max_num_batched_tokens=2048))  # the miss in chunks: bounded memory
    acc: dict[str, float] = {}
    engine.runner.model = Timed(engine.runner.model, {"forward": "forward", "compute_logits": "forward"}, acc)
    engine.runner.builder = Timed(engine.runner.builder, {"build": "build"}, acc)
    rng = random.Random(ctx)
    prompt = [0] + [rng.randrange(2, 1000) for _ in range(ctx - 1)]
    engine.generate([prompt], ONE, use_tqdm=False)  # the miss: fills the cache
    runs = [hit_phases(engine, prompt, f"hit-{i}", acc) for i in range(reps)]
    best = {p: min(r[p] for r in runs) for p in PHASES}
    host_totals = [sum(r[p] for p in PHASES if p != "forward") for r in runs]
    row = {"context": ctx, "reps": reps, "cached_tokens": runs[-1]["cached_tokens"],
           **{f"{p}_ms": round(best[p], 3) for p in PHASES},
           "host_ms": round(min(host_totals), 3), "host_spread_ms": [round(min(host_totals), 2),
                                                                      round(max(host_totals), 2)]}
    engine.shutdown()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2048,8192,32768", help="comma list of prompt lengths (tokens)")
    p.add_argument("--reps", type=int, default=3, help="hits per context; best of them per phase")
    p.add_argument("--scratch", default=None, help="where the checkpoint is written (default: a temp dir)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    args = p.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        p.error(f"--contexts must be a comma list of integers, got {args.contexts!r}")
    if any(c < 128 for c in contexts) or args.reps < 1:
        p.error("--contexts must each be >= 128 tokens and --reps >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    scratch = args.scratch or tempfile.mkdtemp(prefix="prefix-hit-")
    path = make_checkpoint_dir(scratch, max(contexts) + 256)
    rows = []
    for ctx in contexts:
        row = run_context(path, ctx, args.reps, 64)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n| context | {' | '.join(PHASES)} | host (all but forward) |")
    print("| --- |" + " --- |" * (len(PHASES) + 1))
    for r in rows:
        print(f"| {r['context']} | " + " | ".join(f"{r[f'{p}_ms']:.2f}" for p in PHASES) + f" | {r['host_ms']:.2f} |")


if __name__ == "__main__":
    main()
