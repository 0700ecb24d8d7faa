"""TTFT with the prefix cache's tiers: a miss, a device hit, a host-tier hit and a disk-tier hit at one long
context, then two workloads (multi-turn chat, shared documents) with caching off, device only, +host, +disk.

Part 1 (--context, one request at a time, max_tokens=1, so the time is the prefill; median of --reps):
- miss: prefix caching off;
- device hit: the prefix ran before and its blocks are on the device;
- host hit: its blocks were pushed out of a small device cache into the host tier by a filler prompt;
- disk hit: the same with a disk tier and no host tier (the blocks come back from files).
Part 2 (--workloads): requests are submitted in rounds through add_request / step; TTFT is the time from a
request's submission to the step that returns its first token; p50 / p99 over all requests, throughput in
output tokens per second over the whole run, hit rate = cached prompt tokens / prompt tokens looked up.
- chat: --users conversations share a --system-tokens system prompt; each turn adds a user message and the
  previous answer, so every turn's prompt extends the last one;
- doc: --docs documents of --doc-tokens, each asked --questions short questions, round-robin.
The device cache holds --device-fraction of the working set, so the device-only cache evicts and the host /
disk tiers have work to do.

Every engine shares the first one's model (DeepInferenceEngine.from_components): the weights are loaded once, and
each engine adds only its KV pool (sized here from --context, not from free memory) and its decode graphs, so a
full-size checkpoint (V2-Lite: ~31 GB of bf16 weights) runs all its engines on one GPU.

Prints JSON lines, then tables. A checkpoint path, or --make v2-lite:LAYERS to write a random-weight checkpoint
with DeepSeek-V2-Lite shapes and that many layers first (the full 27 layers take long to write: make them once with
`python -m deepinfer.entrypoints.cli make-checkpoint --preset v2-lite --workers 8 /tmp/ckpt-v2-lite`).

  CPU:  python -m benchmarks.kv_tiers_ttft --make bench-v3-11m --device cpu --context 2048 --reps 3
  H200: python -m benchmarks.kv_tiers_ttft /tmp/ckpt-v2-lite --device cuda --context 8192 --reps 5 --workloads ""
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
VOCAB_HI = 1000


def make(spec: str, out_dir: str) -> str:
    """Write the checkpoint `spec` names (a preset, or v2-lite:LAYERS) into out_dir unless it is there."""
    from deepinfer.checkpoints import PRESETS, Preset, make_checkpoint, register_preset

    name, _, layers = spec.partition(":")
    if layers:
        base = PRESETS[name]
        name = f"{name}-{layers}l"
        if name not in PRESETS:
            register_preset(Preset(name, f"{base.description}, {layers} layers", {**base.config,
                                   "num_hidden_layers": int(layers)}, dtype=base.dtype))
    path = os.path.join(out_dir, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        t = time.perf_counter()
        make_checkpoint(name, path, workers=min(8, os.cpu_count() or 1), progress=False)
        print(f"# wrote checkpoint {name} in {time.perf_counter() - t:.0f} s", flush=True)
    return path


class Bench:
    def __init__(self, args):
        self.args = args
        self.base: DeepInferenceEngine | None = None  # the first engine: its model serves every later one

    def engine(self, caching: bool, blocks: int | None = None, host_gib: float | None = None,
               disk: str | None = None, max_len: int | None = None) -> DeepInferenceEngine:
        a = self.args
        cfg = EngineConfig(
            a.checkpoint, device=a.device, dtype=a.dtype, enable_prefix_caching=caching, num_kv_blocks=blocks,
            kv_host_cache_gib=host_gib, kv_disk_cache_dir=disk, max_model_len=max_len or a.max_model_len,
            load_progress=False, max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs)
        if self.base is None:
            self.base = DeepInferenceEngine(cfg)
            return self.base
        b = self.base  # the same weights: loaded once (a full-size checkpoint fits once, not once per engine)
        return DeepInferenceEngine.from_components(cfg, b.model, b.tokenizer, b.backend)

    @staticmethod
    def ttft(engine: DeepInferenceEngine, prompt: list[int]) -> tuple[float, int]:
        t = time.perf_counter()
        out = engine.generate([prompt], ONE, use_tqdm=False)[0]
        return time.perf_counter() - t, out.num_cached_tokens or 0

    # ------------------------------------------------------------ part 1

    def single(self, ctx: int) -> dict:
        a, rng = self.args, random.Random(ctx)
        prefix = [0] + [rng.randrange(2, VOCAB_HI) for _ in range(ctx - 1)]

        def prompt(i: int) -> list[int]:
            return prefix + [(7 * i + k) % VOCAB_HI + 2 for k in range(8)]

        def filler() -> list[int]:
            return [0] + [rng.randrange(2, VOCAB_HI) for _ in range(ctx)]

        # Every engine's pool is sized here, not from free memory: the engines share the GPU (the first would
        # otherwise take gpu_memory_utilization of it). The first, in 16-token blocks (the smallest any backend
        # uses), holds a context whatever its block size; the others are sized in its blocks.
        miss_e = self.engine(False, blocks=a.blocks_per_context, max_len=ctx + 64)
        small = -(-(ctx + 64) // miss_e.kv.block_size) + 2  # one context and a bit: a filler evicts the prefix
        dev_e = self.engine(True, blocks=3 * small, max_len=ctx + 64)  # the prefix stays while a prompt runs
        host_e = self.engine(True, blocks=small, host_gib=a.host_gib, max_len=ctx + 64)
        disk_dir = tempfile.mkdtemp(prefix="kvdisk-", dir=a.scratch)
        disk_e = self.engine(True, blocks=small, disk=disk_dir, max_len=ctx + 64)
        for e in (miss_e, dev_e, host_e, disk_e):
            self.ttft(e, prompt(-1))  # warm; the prefix is cached where caching is on
        res = {k: [] for k in ("miss", "device_hit", "host_hit", "disk_hit")}
        cached = {}
        for i in range(a.reps):  # alternated
            res["miss"].append(self.ttft(miss_e, prompt(i))[0])
            t, cached["device_hit"] = self.ttft(dev_e, prompt(i))
            res["device_hit"].append(t)
            for name, e in (("host_hit", host_e), ("disk_hit", disk_e)):
                self.ttft(e, filler())  # the prefix's blocks leave the device (LRU)
                t, cached[name] = self.ttft(e, prompt(i))
                res[name].append(t)
        disk_e.kv.disk_tier.flush()  # its writer is done before the directory goes
        shutil.rmtree(disk_dir, ignore_errors=True)
        row = {"part": "single", "context": ctx, "reps": a.reps, "block_size": dev_e.kv.block_size}
        for k, v in res.items():
            row[f"{k}_ms"] = 1e3 * statistics.median(v)
            row[f"{k}_spread_ms"] = [round(1e3 * min(v), 2), round(1e3 * max(v), 2)]
        for k in ("device_hit", "host_hit", "disk_hit"):
            row[f"{k}_cached_tokens"] = cached[k]
            row[f"{k}_speedup"] = row["miss_ms"] / row[f"{k}_ms"]
        if a.profile:
            from benchmarks.profile_region import profile_region

            trace = os.path.join(a.scratch, f"kv_ttft_{ctx}.json")
            profile_region(f"miss at {ctx}", lambda: self.ttft(miss_e, prompt(a.reps)), trace)
            profile_region(f"device hit at {ctx}", lambda: self.ttft(dev_e, prompt(a.reps)), trace)
            profile_region(f"host hit at {ctx}", lambda: self.ttft(host_e, prompt(a.reps)), trace,
                           setup=lambda: self.ttft(host_e, filler()))  # the filler pushes the prefix to the host
        tier = host_e.kv._tier
        row["host_tier_copies"] = {"to_host": tier.copies.num_to_host, "to_device": tier.copies.num_to_device,
                                   "calls": tier.copies.num_calls, "transfers": tier.copies.num_transfers}
        # steps whose few tokens (a hit's suffix) replayed the decode graphs as decode rows (worker/decode_rows.py)
        row["decode_row_steps"] = {k: e.runner.short_extends.num_steps for k, e in
                                   (("miss", miss_e), ("device", dev_e), ("host", host_e), ("disk", disk_e))}
        return row

    # ------------------------------------------------------------ part 2

    def chat_rounds(self) -> list[list[list[int]]]:
        a, rng = self.args, random.Random(1)
        system = [0] + [rng.randrange(2, VOCAB_HI) for _ in range(a.system_tokens - 1)]
        convs = [list(system) for _ in range(a.users)]
        rounds = []
        for _ in range(a.turns):
            rnd = []
            for c in convs:
                c += [rng.randrange(2, VOCAB_HI) for _ in range(a.turn_tokens)]
                rnd.append(list(c))
                c += [rng.randrange(2, VOCAB_HI) for _ in range(a.output_tokens)]  # stands for the answer
            rounds.append(rnd)
        return rounds

    def doc_rounds(self) -> list[list[list[int]]]:
        a, rng = self.args, random.Random(2)
        docs = [[0] + [rng.randrange(2, VOCAB_HI) for _ in range(a.doc_tokens - 1)] for _ in range(a.docs)]
        return [[d + [rng.randrange(2, VOCAB_HI) for _ in range(64)] for d in docs] for _ in range(a.questions)]

    def workload(self, name: str, rounds: list[list[list[int]]], config: str) -> dict:
        a = self.args
        longest = max(len(p) for r in rounds for p in r) + a.output_tokens
        working = sum(len(p) for p in rounds[-1]) + longest
        bs = a.block_size
        blocks = int(max(-(-working * a.device_fraction // bs), -(-a.max_model_len // bs) + 2))
        disk = tempfile.mkdtemp(prefix="kvdisk-", dir=a.scratch) if config == "+disk" else None
        e = self.engine(config != "off", blocks=blocks, host_gib=a.host_gib if config in ("+host", "+disk") else None,
                        disk=disk)
        params = SamplingParams(temperature=0.0, max_tokens=a.output_tokens, ignore_eos=True)
        ttfts, out_tokens, n = [], 0, 0
        t0 = time.perf_counter()
        for rnd in rounds:
            start = {}
            for p in rnd:
                rid = f"r{n}"
                n += 1
                e.add_request(rid, p, params)
                start[rid] = time.perf_counter()
            while e.has_unfinished_requests():
                for o in e.step():
                    if o.request_id in start and o.outputs[0].token_ids:
                        ttfts.append(time.perf_counter() - start.pop(o.request_id))
                    if o.finished:
                        out_tokens += len(o.outputs[0].token_ids)
        wall = time.perf_counter() - t0
        kv = e.kv
        if disk:
            kv.disk_tier.flush()  # its writer is done before the directory goes
            shutil.rmtree(disk, ignore_errors=True)
        ttfts.sort()
        return {"part": name, "config": config, "requests": n, "device_blocks": blocks,
                "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2], "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1,
                                                                                             int(0.99 * len(ttfts)))],
                "output_tok_s": out_tokens / wall, "wall_s": wall,
                "hit_rate": kv.prefix_hit_tokens / kv.prefix_queried_tokens if kv.prefix_queried_tokens else 0.0,
                "tier_hit_tokens": kv.prefix_tier_hit_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--make", default=None, help="write this checkpoint first: a preset, or v2-lite:LAYERS")
    ap.add_argument("--scratch", default=tempfile.gettempdir(), help="where --make and the disk tiers write")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--host-gib", type=float, default=4.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="every engine's max_num_seqs: its decode graphs' largest bucket (16: 1, 2, 4, 8, 16 rows, "
                         "quick to capture; a hit's 8-token suffix replays the bucket of 8)")
    ap.add_argument("--workloads", default="chat,doc", help="comma list of chat, doc; empty: part 1 only")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--profile", action="store_true",
                    help="part 1: profile a miss, a device hit and a filler + host hit (device kernels, host Python)")
    ap.add_argument("--device-fraction", type=float, default=0.5, help="device KV cache / working set (part 2)")
    args = ap.parse_args()
    if args.make:
        args.checkpoint = make(args.make, args.scratch)
    if not args.checkpoint:
        ap.error("give a checkpoint path or --make")
    chat_len = args.system_tokens + args.turns * (args.turn_tokens + args.output_tokens)
    args.max_model_len = max(args.context, chat_len, args.doc_tokens + 64) + 64
    args.blocks_per_context = -(-(args.context + 64) // 16) + 2  # block size 16 is the smallest any backend uses
    b = Bench(args)
    t = time.perf_counter()
    single = b.single(args.context)
    args.block_size = single["block_size"]
    print(json.dumps(single), flush=True)
    rows = []
    for name in [w for w in args.workloads.split(",") if w]:
        rounds = {"chat": b.chat_rounds, "doc": b.doc_rounds}[name]()
        for config in ("off", "device", "+host", "+disk"):
            rows.append(b.workload(name, rounds, config))
            print(json.dumps(rows[-1]), flush=True)
    r = single
    print(f"\n{args.checkpoint} on {args.device or 'auto'}, context {r['context']}, median of {r['reps']}")
    print(f"{'':12}{'ms':>10}{'x vs miss':>11}{'cached':>8}")
    print(f"{'miss':12}{r['miss_ms']:>10.1f}")
    for k in ("device_hit", "host_hit", "disk_hit"):
        print(f"{k:12}{r[k + '_ms']:>10.1f}{r[k + '_speedup']:>11.1f}{r[k + '_cached_tokens']:>8}")
    if rows:
        print(f"\n{'workload':9}{'config':8}{'reqs':>5}{'TTFT p50 ms':>12}{'p99 ms':>9}{'out tok/s':>10}{'hit rate':>9}")
        for w in rows:
            print(f"{w['part']:9}{w['config']:8}{w['requests']:>5}{w['ttft_p50_ms']:>12.1f}{w['ttft_p99_ms']:>9.1f}"
                  f"{w['output_tok_s']:>10.1f}{w['hit_rate']:>9.2f}")
    print(f"# total {time.perf_counter() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
