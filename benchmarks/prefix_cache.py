"""Time to first token with the prefix cache: a miss, a device hit and a disk-tier hit of one long shared prefix.

For each context length: a prompt of that many tokens (seeded ids) plus an 8-token suffix that differs per
request. Measured, one request at a time (max_tokens=1, so the time is the prefill):
- miss: prefix caching off;
- device hit: the prefix was run once before, its blocks are still on the device;
- disk hit: a fresh engine on a disk-tier directory another engine filled, so the blocks come back from
  files (only with --disk).
Each measurement is the median of --reps runs, alternated. Prints JSON lines and a table.

  python -m benchmarks.prefix_cache CKPT --context 2048,8192 --device cpu --reps 5 --disk /tmp/kvdisk
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _engine(path: str, args, caching: bool, disk: str | None = None, **kw) -> DeepInferenceEngine:
    kw.setdefault("max_model_len", args.max_model_len)
    return DeepInferenceEngine(EngineConfig(path, device=args.device, dtype=args.dtype, enable_prefix_caching=caching,
                                            kv_disk_cache_dir=disk, load_progress=False, **kw))


def _ttft(engine: DeepInferenceEngine, prompt: list[int]) -> tuple[float, int]:
    t = time.perf_counter()
    out = engine.generate([prompt], ONE, use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens or 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--context", default="2048", help="comma list of shared-prefix lengths")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--disk", default=None, help="a scratch directory for the disk-tier case (emptied first)")
    args = ap.parse_args()
    contexts = [int(c) for c in args.context.split(",")]
    args.max_model_len = args.max_model_len or max(contexts) + 64
    vocab_hi = 1000
    rows = []
    miss_e, hit_e = _engine(args.checkpoint, args, False), _engine(args.checkpoint, args, True)
    for ctx in contexts:
        rng = random.Random(ctx)
        prefix = [0] + [rng.randrange(2, vocab_hi) for _ in range(ctx - 1)]

        def prompt(i: int) -> list[int]:
            return prefix + [(7 * i + k) % vocab_hi + 2 for k in range(8)]

        _ttft(hit_e, prompt(-1))  # warm: the prefix's blocks are on the device now
        _ttft(miss_e, prompt(-1))
        miss, hit, cached = [], [], 0
        for i in range(args.reps):  # alternated
            miss.append(_ttft(miss_e, prompt(i))[0])
            t, cached = _ttft(hit_e, prompt(i))
            hit.append(t)
        row = {"context": ctx, "miss_ms": 1e3 * statistics.median(miss), "device_hit_ms": 1e3 * statistics.median(hit),
               "cached_tokens": cached}
        if args.disk:
            shutil.rmtree(args.disk, ignore_errors=True)
            filler = _engine(args.checkpoint, args, True, args.disk, num_kv_blocks=-(-(ctx + 64) // 16) + 8,
                             max_model_len=ctx + 64)
            _ttft(filler, prompt(-2))
            # push the prefix's blocks out to the directory: they are the least recently used, so they go first
            tier, need = filler.kv.disk_tier, ctx // filler.kv.block_size
            for _ in range(100):
                if tier.puts >= need:
                    break
                _ttft(filler, [0] + [rng.randrange(2, vocab_hi) for _ in range(ctx)])
            disk = []
            for i in range(args.reps):
                fresh = _engine(args.checkpoint, args, True, args.disk)  # a restart: an empty device cache
                t, c = _ttft(fresh, prompt(100 + i))
                disk.append(t)
                row["disk_cached_tokens"] = c
            row["disk_hit_ms"] = 1e3 * statistics.median(disk)
        row["device_speedup"] = row["miss_ms"] / row["device_hit_ms"]
        if "disk_hit_ms" in row:
            row["disk_speedup"] = row["miss_ms"] / row["disk_hit_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'context':>8} {'miss ms':>9} {'device hit ms':>14} {'x':>6} {'disk hit ms':>12} {'x':>6}")
    for r in rows:
        print(f"{r['context']:>8} {r['miss_ms']:>9.1f} {r['device_hit_ms']:>14.1f} {r['device_speedup']:>6.1f} "
              f"{r.get('disk_hit_ms', float('nan')):>12.1f} {r.get('disk_speedup', float('nan')):>6.1f}")


if __name__ == "__main__":
    main()
